"""A small simulated cluster that speaks PROTOCOL.md for real, as another team's nodes would.

Each node registers its agents over the HTTP API, heartbeats over MQTT, answers a
TASK_REQUEST with ACK then TASK_RESPONSE (or NACK / BUSY / a failed response, by the knobs),
de-duplicates on the idempotency key, and sends tasks to the other nodes' agents. It uses
only the public contract (HTTP API, MQTT topics), no ORM, so tests can use it as a real peer.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import paho.mqtt.client as mqtt

from messages import protocol, signing
from messages.mqtt_client import (
    broker_target,
    connect_failure_reason,
    mqtt_client,
    refusal_reason,
)

log = logging.getLogger(__name__)
MT = protocol.MessageType

NAMESPACES = {
    "fin": ["tax", "vat-report", "bank-statement", "invoice"],
    "llm": ["chat", "summarize", "translate", "bank-statement"],
    "web": ["web_search", "crawl", "scrape"],
    "ops": ["backup", "notify", "inventory"],
}


# What one agent can be made to do wrong while the cluster runs (runconsole's flags, the
# /practice/ page): the words say what an operator will see.
FAULTS = {
    "": "works normally",
    "slow": "answers, but takes 8 s a task",
    "failing": "accepts every task and fails it (TASK_RESPONSE ok=false)",
    "silent": "says nothing: no ACK, no answer (its tasks are retried, then fail)",
}
SLOW_FAULT_MS = 8000


@dataclass
class SimulatedAgent:
    agent_id: str
    capabilities: list[str]
    groups: list[str]
    max_inflight: int
    inflight: int = 0
    fault: str = ""  # a key of FAULTS


@dataclass
class Knobs:
    rate: float = 2.0  # tasks per second, the whole cluster
    fail_rate: float = 0.0  # share of tasks answered with ok=false
    busy_rate: float = 0.0  # share of requests answered BUSY
    nack_rate: float = 0.0  # share of requests refused with NACK
    slow_ms: int = 50  # time to do a task
    kill_node_after: float | None = None  # the last node goes silent after this many seconds
    busy_nodes: frozenset[str] = frozenset()  # nodes that answer every request BUSY


def fault_arguments_add(parser, *, prefix: str = "") -> None:
    """The fault knobs as command-line flags: `manage.py simulate`'s, and runconsole's for
    its own cluster (with `prefix` "simulate-"). Read back with knobs_from."""
    def add(name: str, kind: type, default, words: str) -> None:
        parser.add_argument(f"--{prefix}{name}", type=kind, default=default, help=words)

    add("fail-rate", float, 0.0, "share of tasks, 0 to 1, answered with ok=false (TASK_ERROR; "
        "default 0)")
    add("busy-rate", float, 0.0, "share of requests, 0 to 1, answered BUSY (default 0)")
    add("nack-rate", float, 0.0, "share of requests, 0 to 1, refused with a NACK (default 0)")
    add("slow-ms", int, 50, "milliseconds each task takes before its answer (default 50)")
    add("kill-node-after", float, None, "seconds after which the last node goes silent "
        "(default: never)")


def knobs_from(options: dict, *, rate: float, prefix: str = "") -> Knobs:
    """The Knobs that fault_arguments_add's flags asked for."""
    def get(name: str):
        return options[(prefix + name).replace("-", "_")]

    return Knobs(rate=rate, fail_rate=get("fail-rate"), busy_rate=get("busy-rate"),
                 nack_rate=get("nack-rate"), slow_ms=get("slow-ms"),
                 kill_node_after=get("kill-node-after"))


def _published(info: mqtt.MQTTMessageInfo) -> bool:
    # paho raises for a message published while disconnected (its rc stays NO_CONN even
    # once it is resent): ask whether the broker confirmed it, not how it first went.
    try:
        return info.is_published()
    except (RuntimeError, ValueError):
        return info._published  # noqa: SLF001  (set on its PUBACK either way)


class BrokerUnusable(RuntimeError):
    """The simulated nodes cannot use the broker; the words say why and what to pass."""


def broker_protocol_detect(mqtt_url: str, *, timeout: float = 5.0) -> str:
    """The MQTT version the broker at `mqtt_url` speaks: "5", or "3.1.1" when it refuses
    MQTT 5 for its version (as `make run`'s embedded broker does). Raises BrokerUnusable, with
    words, when it cannot be reached or refuses for any other reason."""
    target = broker_target(mqtt_url, protocol="5")
    client = mqtt_client(target=target, client_id=f"sim-probe-{secrets.token_hex(4)}")
    answers: queue.Queue = queue.Queue()
    client.on_connect = lambda c, userdata, flags, reason_code, properties: answers.put(
        reason_code)
    try:
        client.connect(target.host, target.port, keepalive=10)
    except OSError as exc:
        why = connect_failure_reason(target) or str(exc)
        raise BrokerUnusable(f"no MQTT broker answers at {target.display}: {why}. Is the "
                             "console running (make run starts one on 127.0.0.1:1883)? Pass "
                             "--mqtt-url mqtt://host:port") from exc
    client.loop_start()
    try:
        reason = answers.get(timeout=timeout)
    except queue.Empty:
        raise BrokerUnusable(f"the broker at {target.display} did not answer an MQTT 5 CONNECT "
                             f"within {timeout:g} s: pass --mqtt-protocol 3.1.1 if it speaks "
                             "only that") from None
    finally:
        client.disconnect()
        client.loop_stop()
    if not reason.is_failure:
        return "5"
    if getattr(reason, "value", reason) in (132, 1):  # Unsupported protocol version
        return "3.1.1"
    raise BrokerUnusable(refusal_reason(reason, target))


def cluster_plan(*, nodes: int, agents: int, seed: int = 7, tag: str = "") -> list[SimulatedNode]:
    """Spread `agents` over `nodes` deterministically for a given seed. A `tag` is added to
    every node and agent name, so a second simulated cluster can run beside the first."""
    rng = random.Random(seed)
    pool = [(ns, name) for ns, names in NAMESPACES.items() for name in names]
    tagged = f"-{tag}" if tag else ""
    plan = [SimulatedNode(node_id=f"sim-node-{chr(ord('a') + i)}{tagged}")
            for i in range(nodes)]
    for i in range(agents):
        ns, name = pool[i % len(pool)]
        suffix = ("" if i < len(pool) else f"-{i // len(pool) + 1}") + tagged
        plan[i % nodes].agents.append(SimulatedAgent(
            agent_id=f"{ns}.{name}{suffix}", capabilities=[name], groups=[f"#{ns}-team"],
            max_inflight=rng.choice([4, 8, 16]),
        ))
    return plan


@dataclass
class SimulatedNode:
    node_id: str
    agents: list[SimulatedAgent] = field(default_factory=list)
    heartbeat_ms: int = 5000
    alive: bool = True
    executions: Counter = field(default_factory=Counter)  # idempotency key → times executed
    received: Counter = field(default_factory=Counter)  # message type → count
    duplicates: int = 0
    responses: dict[str, dict] = field(default_factory=dict)  # request id → response payload
    client: mqtt.Client | None = None
    connect_error: str = ""  # why the broker refused this node's last CONNECT
    connected: threading.Event = field(default_factory=threading.Event)
    work: queue.Queue = field(default_factory=queue.Queue)
    seen_keys: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    subscribed: threading.Event = field(default_factory=threading.Event)

    def hosts(self, agent_id: str | None) -> bool:
        return any(a.agent_id == agent_id for a in self.agents)


class SimulatedCluster:
    def __init__(self, *, base_url: str, token: str, mqtt_url: str, nodes: int = 3,
                 agents: int = 12, knobs: Knobs | None = None, seed: int = 7,
                 prefix: str = "ooder", source: str = "studio", mqtt_protocol: str = "5",
                 heartbeat_ms: int | None = None, keyring: signing.Keyring | None = None,
                 tag: str = ""):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"the console URL must be http(s)://…, not {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.source = source
        # TLS and credentials as the console's own (MQTT_CA_FILE, MQTT_USERNAME, …).
        self.mqtt = broker_target(mqtt_url, protocol=mqtt_protocol)
        self.prefix = prefix
        self.knobs = knobs or Knobs()
        self.heartbeat_ms = heartbeat_ms
        self.nodes = cluster_plan(nodes=nodes, agents=agents, seed=seed, tag=tag)
        # Each node signs with its own key when the console holds keys (handed out here as
        # `manage.py node_key` would; docs/protocol.md "Signatures").
        self.keys = {n.node_id: keyring.signing_key(n.node_id) for n in self.nodes} if keyring \
            else {}
        self.rng = random.Random(seed)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.http_errors = 0
        self.sent_requests = 0  # task requests made (their `n`), whether or not they left
        self._count_lock = threading.Lock()
        self._unconfirmed: list[mqtt.MQTTMessageInfo] = []  # requests not PUBACKed yet
        self._confirmed = 0

    # --- HTTP: lifecycle ---------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict | None = None) -> dict | None:
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(  # noqa: S310 - the scheme is checked in __init__
            f"{self.base_url}{path}", data=data, method=method,
            headers={"Authorization": f"Bearer {self.token}", "X-OODER-Source": self.source,
                     "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            self.http_errors += 1
            log.warning("simulator: %s %s → %s %s", method, path, exc.code,
                        exc.read()[:200].decode(errors="replace"))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self.http_errors += 1
            log.warning("simulator: %s %s failed: %s", method, path, exc)
        return None

    def register(self, node: SimulatedNode) -> bool:
        ok = True
        for agent in node.agents:
            lease = self._call("POST", "/api/roster/agents", {
                "agentId": agent.agent_id, "nodeId": node.node_id, "version": "sim-1",
                "capabilities": agent.capabilities, "groups": agent.groups,
                "maxInflight": agent.max_inflight, "metadata": {"simulated": True},
            })
            if lease:
                node.heartbeat_ms = self.heartbeat_ms or lease["heartbeatMs"]
            ok = ok and lease is not None
        return ok

    # --- MQTT ----------------------------------------------------------------------------------
    def _connect(self, node: SimulatedNode) -> None:
        client = mqtt_client(target=self.mqtt, client_id=f"sim-{node.node_id}",
                             clean_session=False)
        inbox = protocol.inbox_topic(self.prefix, node.node_id)

        def on_connect(c, userdata, flags, reason_code, properties):
            if reason_code.is_failure:
                node.connect_error = refusal_reason(reason_code, self.mqtt)
                log.warning("simulator: %s cannot connect: %s", node.node_id,
                            node.connect_error)
                return
            node.connect_error = ""
            node.connected.set()
            c.subscribe(inbox, qos=1)

        def on_message(c, userdata, message):
            node.work.put(message.payload)

        def on_subscribe(c, userdata, mid, reason_codes, properties):
            node.subscribed.set()

        client.on_connect = on_connect
        client.on_message = on_message
        client.on_subscribe = on_subscribe
        client.suppress_exceptions = True
        client.reconnect_delay_set(1, 5)
        client.connect_async(self.mqtt.host, self.mqtt.port, keepalive=30)
        client.loop_start()
        node.client = client

    def _publish(self, node: SimulatedNode, to_node: str,
                 env: protocol.Envelope) -> mqtt.MQTTMessageInfo | None:
        client = node.client  # once: node_stop may clear it meanwhile
        if client is None:
            return None
        return client.publish(protocol.inbox_topic(self.prefix, to_node),
                                   protocol.encode(env, key=self.keys.get(node.node_id)), qos=1)

    @property
    def published_requests(self) -> int:
        """Task requests the broker confirmed (PUBACK)."""
        return self._confirmations_count()

    def _confirmations_count(self) -> int:
        # Read from paho's message infos, not counted in on_publish: paho calls that holding
        # its own lock, which a publishing thread may be waiting on. The confirmed ones are
        # dropped from the list as they are counted.
        with self._count_lock:
            still = [info for info in self._unconfirmed if not _published(info)]
            self._confirmed += len(self._unconfirmed) - len(still)
            self._unconfirmed = still
            return self._confirmed

    def _reply(self, node: SimulatedNode, request: protocol.Envelope, kind: MT,
               payload: dict, **headers) -> None:
        reply_to = request.reply_node_id
        if not reply_to:
            return
        env = protocol.new_envelope(
            message_type=kind, from_agent_id=request.to_agent_id or node.node_id,
            to_agent_id=request.from_agent_id, task_id=request.task_id,
            conversation_id=request.conversation_id, target_node_id=reply_to,
            headers={"originNodeId": node.node_id, "replyNodeId": node.node_id, **headers},
            payload=payload,
        )
        self._publish(node, reply_to, env)

    def heartbeat(self, node: SimulatedNode) -> None:
        agents = []
        for agent in node.agents:
            # The load reported is the real one: tasks this agent is working on right now.
            agents.append({"agentId": agent.agent_id, "inflight": agent.inflight,
                           "queueDepth": node.work.qsize(), "maxInflight": agent.max_inflight})
        env = protocol.new_envelope(
            message_type=MT.HEARTBEAT, from_agent_id=node.node_id,
            headers={"originNodeId": node.node_id},
            payload={"heartbeatMs": node.heartbeat_ms, "agents": agents},
        )
        client = node.client  # once: node_stop may clear it meanwhile
        if client is not None:
            client.publish(protocol.heartbeat_topic(self.prefix, node.node_id),
                                protocol.encode(env, key=self.keys.get(node.node_id)), qos=0)

    def handle(self, node: SimulatedNode, raw: bytes) -> None:
        env = protocol.decode(raw)
        if isinstance(env, protocol.Rejection):
            node.received["rejected"] += 1
            return
        node.received[env.message_type.value] += 1
        if env.message_type == MT.TASK_RESPONSE:
            self._reply(node, env, MT.ACK, {}, ackFor=env.message_id)
            with node.lock:
                node.responses[env.in_reply_to or ""] = env.payload
            return
        if env.message_type != MT.TASK_REQUEST:
            return
        if not node.hosts(env.to_agent_id):
            self._reply(node, env, MT.NACK, {"reason": f"{node.node_id} hosts no agent "
                        f"{env.to_agent_id}", "retryable": False}, ackFor=env.message_id)
            return
        agent = next(a for a in node.agents if a.agent_id == env.to_agent_id)
        if agent.fault == "silent":
            return  # not even remembered: a retry is as unanswered as the first try
        key = env.idempotency_key
        with node.lock:
            duplicate = key in node.seen_keys
            node.seen_keys[key] = time.monotonic()
        if duplicate:
            node.duplicates += 1
            self._reply(node, env, MT.ACK, {"duplicate": True}, ackFor=env.message_id)
            return
        roll = self.rng.random()
        if node.node_id in self.knobs.busy_nodes or roll < self.knobs.busy_rate:
            with node.lock:
                node.seen_keys.pop(key, None)  # not accepted: a later try may run it
            self._reply(node, env, MT.BUSY, {}, ackFor=env.message_id)
            return
        if roll < self.knobs.busy_rate + self.knobs.nack_rate:
            self._reply(node, env, MT.NACK, {"reason": "simulated refusal", "retryable": True},
                        ackFor=env.message_id)
            return
        self._reply(node, env, MT.ACK, {}, ackFor=env.message_id)
        with node.lock:
            node.executions[key] += 1
            agent.inflight += 1
        failed = agent.fault == "failing" or self.rng.random() < self.knobs.fail_rate
        if agent.fault == "slow":
            # On a timer: the node goes on heartbeating and answering its other agents.
            timer = threading.Timer(SLOW_FAULT_MS / 1000, self._finish,
                                    args=(node, agent, env, failed))
            timer.daemon = True
            timer.start()
            return
        if self.knobs.slow_ms:
            time.sleep(self.knobs.slow_ms / 1000)
        self._finish(node, agent, env, failed)

    def _finish(self, node: SimulatedNode, agent: SimulatedAgent, env: protocol.Envelope,
                failed: bool) -> None:
        with node.lock:
            agent.inflight -= 1
        if failed:
            why = "fault: failing" if agent.fault == "failing" else "--fail-rate"
            payload = {"ok": False, "error": f"simulated failure ({why})"}
        else:
            payload = {"ok": True, "result": {"echo": env.payload, "by": node.node_id}}
        self._reply(node, env, MT.TASK_RESPONSE, payload, inReplyTo=env.message_id)

    # --- faults on purpose, while it runs ------------------------------------------------------
    def node(self, node_id: str) -> SimulatedNode:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no simulated node {node_id!r}: "
                       f"{', '.join(n.node_id for n in self.nodes)}")

    def agent(self, agent_id: str) -> SimulatedAgent:
        for node in self.nodes:
            for agent in node.agents:
                if agent.agent_id == agent_id:
                    return agent
        raise KeyError(f"no simulated agent {agent_id!r}")

    def agent_fault(self, agent_id: str, fault: str) -> None:
        """Make one agent slow, failing or silent ("" for normal again)."""
        if fault not in FAULTS:
            raise ValueError(f"fault {fault!r}: use one of "
                             f"{', '.join(repr(f) for f in FAULTS)}")
        self.agent(agent_id).fault = fault
        log.warning("simulator: %s now %s", agent_id, FAULTS[fault])

    def node_stop(self, node_id: str) -> None:
        """The node goes silent: no heartbeat, no answer, its broker connection closed (its
        session keeps what comes meanwhile, as a crashed node's would)."""
        node = self.node(node_id)
        node.alive = False
        client, node.client = node.client, None
        node.connected.clear()
        node.subscribed.clear()
        if client is not None:
            client.disconnect()
            client.loop_stop()
        log.warning("simulator: %s stopped", node_id)

    def node_start(self, node_id: str) -> None:
        """A stopped node comes back: it connects again and heartbeats."""
        node = self.node(node_id)
        if node.alive:
            return
        node.alive = True
        self._connect(node)
        log.warning("simulator: %s started again", node_id)

    def send_task(self, node: SimulatedNode) -> None:
        others = [n for n in self.nodes if n is not node and n.agents]
        if not others or not node.agents:
            return
        target_node = self.rng.choice(others)
        target = self.rng.choice(target_node.agents)
        sender = self.rng.choice(node.agents)
        task_id = f"sim-task-{self.rng.getrandbits(48):012x}"
        env = protocol.new_envelope(
            message_type=MT.TASK_REQUEST, from_agent_id=sender.agent_id,
            to_agent_id=target.agent_id, target_node_id=target_node.node_id, task_id=task_id,
            conversation_id=f"sim-conv-{self.rng.randint(1, 5)}",
            headers={"replyNodeId": node.node_id, "originNodeId": node.node_id,
                     "idempotencyKey": task_id, "timeoutMs": 30000, "attempt": 1},
            payload={"input": {"n": self.sent_requests}},
        )
        self.sent_requests += 1
        info = self._publish(node, target_node.node_id, env)
        if info is not None:
            with self._count_lock:
                self._unconfirmed.append(info)
                crowded = len(self._unconfirmed) > 1000
            if crowded:  # nobody may read the count (make run's cluster): keep it short
                self._confirmations_count()

    # --- lifecycle -------------------------------------------------------------------------------
    def _run_node(self, node: SimulatedNode, index: int) -> None:
        while not self._stop.is_set() and not self.register(node):
            self._stop.wait(1.0)
        self._connect(node)
        # A node announces itself (heartbeats) only once it can hear its inbox.
        node.subscribed.wait(10)
        started = time.monotonic()
        killed = False
        next_beat = 0.0
        per_node_rate = self.knobs.rate / max(1, len(self.nodes))
        next_task = time.monotonic() + (self.rng.random() / per_node_rate if per_node_rate else 0)
        while not self._stop.is_set():
            now = time.monotonic()
            if (self.knobs.kill_node_after is not None and index == len(self.nodes) - 1
                    and now - started > self.knobs.kill_node_after and not killed):
                killed = True
                log.warning("simulator: %s goes silent (--kill-node-after)", node.node_id)
                self.node_stop(node.node_id)
            if not node.alive:
                self._stop.wait(0.2)
                continue
            if now >= next_beat:
                self.heartbeat(node)
                next_beat = now + node.heartbeat_ms / 1000
            if per_node_rate and now >= next_task:
                self.send_task(node)
                next_task = now + self.rng.expovariate(per_node_rate)
            try:
                raw = node.work.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                self.handle(node, raw)
            except Exception:  # a simulator bug must not take the node down
                log.exception("simulator: %s failed to handle a message", node.node_id)

    def start(self) -> None:
        for index, node in enumerate(self.nodes):
            thread = threading.Thread(target=self._run_node, args=(node, index),
                                      name=f"sim-{node.node_id}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def connect_errors(self, timeout: float = 10.0) -> dict[str, str]:
        """Why nodes could not connect to the broker within `timeout`, by node: {} when all
        did. A node still registering over HTTP is not judged (see http_errors)."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            node.connected.wait(max(0.0, deadline - time.monotonic()))
        return {node.node_id: node.connect_error or
                f"no answer from {self.mqtt.display} within {timeout:g} s"
                for node in self.nodes if not node.connected.is_set() and node.client}

    def wait_subscribed(self, timeout: float = 15.0) -> bool:
        """Whether every node hears its inbox (its SUBACK came) within `timeout`. A lease in
        the roster does not say so: registering over HTTP renews one too, and a request
        published before the subscription is granted matches nothing on the broker."""
        deadline = time.monotonic() + timeout
        return all(node.subscribed.wait(max(0.0, deadline - time.monotonic()))
                   for node in self.nodes)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        for node in self.nodes:
            if node.client is not None:
                node.client.disconnect()
                node.client.loop_stop()

    def executions(self) -> Counter:
        total: Counter = Counter()
        for node in self.nodes:
            total.update(node.executions)
        return total
