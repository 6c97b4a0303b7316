"""A remote node that speaks PROTOCOL.md, for fault runs against a console in production shape.

It registers its agents over HTTP, heartbeats over MQTT every `heartbeat_s`, subscribes to its
own inbox only (QoS 1), and answers each TASK_REQUEST the way a well-behaved node does: ACK at
once, execute at most once per idempotency key, then TASK_RESPONSE. A repeated key is answered
ACK `{"duplicate": true}`; when the work has finished, with the TASK_RESPONSE again (addressed to
the new transmission), and when it is still running, the response goes to every transmission
that asked for it once it finishes.

Its MQTT session is persistent (fixed client id, clean_start False, a session expiry): a broker
with persistence keeps the subscription and the queued messages across a restart, and the node
resubscribes in on_connect anyway. `executions` counts executions per idempotency key and
`executions_by_task` per task id, so a test can assert that nothing ran twice, even when a
retry came with another key.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from messages import protocol, signing
from messages.mqtt_client import broker_target, mqtt_client

log = logging.getLogger(__name__)
MT = protocol.MessageType


@dataclass
class _Work:
    """One idempotency key: who asked for it, and its answer once it is done."""

    task_id: str | None
    requests: list[protocol.Envelope] = field(default_factory=list)
    response: dict | None = None


class FakeNode:
    def __init__(self, *, base_url: str, token: str, mqtt_host: str, mqtt_port: int,
                 prefix: str, node_id: str, agents: list[str], max_inflight: int = 8,
                 work_s: float = 0.05, heartbeat_s: float = 2.0, session_expiry_s: int = 3600,
                 source: str = "studio", workers: int = 16, key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.source = source
        self.mqtt_host, self.mqtt_port = mqtt_host, mqtt_port
        self.prefix = prefix
        self.node_id = protocol.validate_node_id(node_id)
        # Its own signing key (`manage.py node_key`): it signs everything it sends, and
        # checks what it receives (docs/protocol.md "Signatures"), counted in `verdicts`.
        self.key = signing.node_key_parse(key, node_id=self.node_id) if key else None
        self.verdicts: Counter = Counter()
        self.agents = list(agents)
        self.max_inflight = max_inflight
        self.work_s = work_s
        self.heartbeat_s = heartbeat_s
        self.session_expiry_s = session_expiry_s
        self.client_id = f"fakenode-{prefix}-{node_id}"[:64]
        self.inbox = protocol.inbox_topic(prefix, node_id)

        self.executions: Counter = Counter()  # idempotency key → times executed
        self.executions_by_task: Counter = Counter()  # task id → times executed
        self.received: Counter = Counter()  # message type (or "rejected") → count
        self.sent: Counter = Counter()  # message type → count
        self.publish_errors: Counter = Counter()
        self.duplicates = 0
        self.canceled: list[str | None] = []  # the cancelFor of every CANCEL it was sent
        self.connects: list[tuple[float, bool]] = []  # (time, session present)
        self.disconnects = 0
        # task id → when its first TASK_RESPONSE was published (wall clock): the start of the
        # fault runs' publish → row latency.
        self.responded_at: dict[str, float] = {}
        self.subscribed = threading.Event()
        self.connected = threading.Event()
        self.callback_errors = 0
        self.handler_errors = 0

        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._work: dict[str, _Work] = {}
        self._inflight: Counter = Counter()  # agent → executing now
        self._queue: queue.Queue = queue.Queue()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{node_id}-run")
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._client: mqtt.Client | None = None

    # --- HTTP: registration -------------------------------------------------------------------
    def _post(self, path: str, body: dict) -> tuple[int, Any]:
        request = urllib.request.Request(
            f"{self.base_url}{path}", data=json.dumps(body).encode(), method="POST",
            headers={"Authorization": f"Bearer {self.token}", "X-OODER-Source": self.source,
                     "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()[:500].decode(errors="replace")

    def register(self, timeout: float = 30) -> dict[str, Any]:
        """Register every agent (retrying while the console is not there yet)."""
        leases = {}
        deadline = time.monotonic() + timeout
        for agent_id in self.agents:
            while True:
                try:
                    status, body = self._post("/api/roster/agents", {
                        "agentId": agent_id, "nodeId": self.node_id,
                        "maxInflight": self.max_inflight,
                    })
                except OSError as exc:
                    status, body = 0, str(exc)
                if status in (200, 201):
                    leases[agent_id] = body
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.node_id}: registering {agent_id} failed: "
                                       f"{status} {body}")
                time.sleep(0.5)
        return leases

    # --- MQTT ---------------------------------------------------------------------------------
    def start(self, *, register: bool = True, timeout: float = 30) -> FakeNode:
        if register:
            self.register(timeout)
        # The console's own factory: a broker that wants credentials gets the configured ones.
        client = mqtt_client(client_id=self.client_id, target=broker_target(
            f"mqtt://{self.mqtt_host}:{self.mqtt_port}", protocol="5"))
        client.on_connect = self._guard(self._on_connect)
        client.on_disconnect = self._guard(self._on_disconnect)
        client.on_subscribe = self._guard(self._on_subscribe)
        client.on_message = self._guard(self._on_message)
        client.suppress_exceptions = True
        client.max_queued_messages_set(0)  # unbounded: the test wants every answer out
        client.max_inflight_messages_set(100)
        client.reconnect_delay_set(min_delay=0.2, max_delay=2)
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.session_expiry_s
        client.connect_async(self.mqtt_host, self.mqtt_port, keepalive=10, clean_start=False,
                             properties=props)
        self._client = client
        client.loop_start()
        for target, name in ((self._handle_loop, "handle"), (self._heartbeat_loop, "beat")):
            thread = threading.Thread(target=target, name=f"{self.node_id}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if not self.subscribed.wait(timeout):
            raise RuntimeError(f"{self.node_id} could not subscribe to {self.inbox} "
                               f"at mqtt://{self.mqtt_host}:{self.mqtt_port}")
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._client is not None:
            self._client.disconnect()
            self._client.loop_stop()
            self._client = None

    def _guard(self, callback):
        def guarded(*args):
            try:
                callback(*args)
            except Exception:
                self.callback_errors += 1
                log.exception("%s: MQTT callback %s failed", self.node_id, callback.__name__)
        return guarded

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("%s: broker refused the connection: %s", self.node_id, reason_code)
            return
        self.connects.append((time.time(), bool(flags.session_present)))
        self.connected.set()
        # Whatever session_present says: a broker that lost the session must not leave us deaf.
        client.subscribe(self.inbox, qos=1)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        self.disconnects += 1

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        if all(not rc.is_failure for rc in reason_codes):
            self.subscribed.set()

    def _on_message(self, client, userdata, message) -> None:
        self._queue.put(message.payload)

    def _publish(self, to_node: str, env: protocol.Envelope, *, qos: int = 1,
                 topic: str | None = None) -> None:
        client = self._client
        if client is None:
            return
        data = protocol.encode(env, key=self.key)
        with self._publish_lock:
            info = client.publish(topic or protocol.inbox_topic(self.prefix, to_node), data,
                                  qos=qos)
        if info.rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            # NO_CONN: paho keeps a QoS 1 message and sends it after the reconnect.
            self.sent[str(env.message_type)] += 1
        else:
            self.publish_errors[mqtt.error_string(info.rc)] += 1

    # --- heartbeats -----------------------------------------------------------------------------
    def heartbeat(self) -> None:
        with self._lock:
            agents = [{"agentId": a, "inflight": self._inflight[a],
                       "queueDepth": self._queue.qsize(), "maxInflight": self.max_inflight}
                      for a in self.agents]
        env = protocol.new_envelope(
            message_type=MT.HEARTBEAT, from_agent_id=self.node_id,
            headers={"originNodeId": self.node_id},
            payload={"heartbeatMs": int(self.heartbeat_s * 1000), "agents": agents},
        )
        self._publish(self.node_id, env, qos=0,
                      topic=protocol.heartbeat_topic(self.prefix, self.node_id))

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            if self.connected.is_set():
                try:
                    self.heartbeat()
                except Exception:
                    log.exception("%s: heartbeat failed", self.node_id)
            self._stop.wait(self.heartbeat_s)

    # --- requests -------------------------------------------------------------------------------
    def _handle_loop(self) -> None:
        while not self._stop.is_set():
            try:
                raw = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self.handle(raw)
            except Exception:
                self.handler_errors += 1
                log.exception("%s: handling a message failed", self.node_id)

    def _reply(self, request: protocol.Envelope, kind: MT, payload: dict, *,
               to_node: str | None = None, **headers) -> None:
        to_node = to_node or request.reply_node_id
        if not to_node:
            return
        env = protocol.new_envelope(
            message_type=kind, from_agent_id=request.to_agent_id or self.node_id,
            to_agent_id=request.from_agent_id, task_id=request.task_id,
            target_node_id=to_node, conversation_id=request.conversation_id,
            scene_group_id=request.scene_group_id, session_id=request.session_id,
            headers={"originNodeId": self.node_id, **headers}, payload=payload,
        )
        if kind == MT.TASK_RESPONSE and request.task_id:
            self.responded_at.setdefault(request.task_id, time.time())
        self._publish(to_node, env)

    def handle(self, raw: bytes) -> None:
        env = protocol.decode(raw)
        if isinstance(env, protocol.Rejection):
            self.received["rejected"] += 1
            return
        self.received[str(env.message_type)] += 1
        if self.key is not None:
            # What the console sends a node is signed with that node's own key.
            verdict = signing.signature_check(
                message=env.wire_message, signature=env.signature, node_id=self.node_id,
                keyring=signing.OwnKey(self.key))
            self.verdicts[verdict.code] += 1
        if env.message_type == MT.CANCEL:
            # PROTOCOL.md: a receiver that knows the type answers ACK; this node cannot stop
            # work already running, so it says so (its response still comes).
            self.canceled.append(env.headers.get("cancelFor"))
            self._reply(env, MT.ACK, {"stopped": False}, ackFor=env.message_id)
            return
        if env.message_type != MT.TASK_REQUEST:
            return  # ACKs of our responses and anything else: counted, nothing to do
        if not env.reply_node_id:
            # PROTOCOL.md: not run; refused to the origin when it is known.
            if env.origin_node_id:
                self._reply(env, MT.NACK, {"reason": "the request has no headers.replyNodeId",
                                           "retryable": False},
                            to_node=env.origin_node_id, ackFor=env.message_id)
            return
        if env.to_agent_id not in self.agents:
            self._reply(env, MT.NACK, {"reason": f"{self.node_id} hosts no agent "
                                                 f"{env.to_agent_id}", "retryable": False},
                        ackFor=env.message_id)
            return
        key = env.idempotency_key
        with self._lock:
            work = self._work.get(key)
            if work is None:
                work = self._work[key] = _Work(task_id=env.task_id, requests=[env])
                self.executions[key] += 1
                self.executions_by_task[env.task_id or key] += 1
                self._inflight[env.to_agent_id] += 1
                fresh, done = True, None
            else:
                self.duplicates += 1
                fresh, done = False, work.response
                if done is None:
                    work.requests.append(env)  # answered when the work finishes
        if fresh:
            self._reply(env, MT.ACK, {}, ackFor=env.message_id)
            self._pool.submit(self._execute, key, env)
            return
        self._reply(env, MT.ACK, {"duplicate": True}, ackFor=env.message_id)
        if done is not None:
            self._reply(env, MT.TASK_RESPONSE, done, inReplyTo=env.message_id)

    def _execute(self, key: str, env: protocol.Envelope) -> None:
        try:
            if self.work_s:
                time.sleep(self.work_s)
            result = {"ok": True, "result": {"echo": env.payload, "by": self.node_id,
                                             "agent": env.to_agent_id}}
        except Exception as exc:  # never: but a failure is an answer, not silence
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        with self._lock:
            work = self._work[key]
            work.response = result
            asked, work.requests = work.requests, []
            self._inflight[env.to_agent_id] -= 1
        for request in asked:
            self._reply(request, MT.TASK_RESPONSE, result, inReplyTo=request.message_id)

    # --- what happened --------------------------------------------------------------------------
    def executed_twice(self) -> dict[str, int]:
        """Task ids (or keys) executed more than once."""
        with self._lock:
            twice = {k: n for k, n in self.executions_by_task.items() if n > 1}
            twice.update({k: n for k, n in self.executions.items() if n > 1})
        return twice

    def stats(self) -> dict[str, Any]:
        with self._lock:
            pending = sum(1 for w in self._work.values() if w.response is None)
        return {
            "received": dict(self.received), "sent": dict(self.sent),
            "executed_keys": len(self.executions), "duplicates": self.duplicates,
            "pending": pending, "connects": len(self.connects),
            "reconnects_with_session": sum(1 for _, present in self.connects[1:] if present),
            "reconnects_without_session": sum(1 for _, present in self.connects[1:]
                                              if not present),
            "disconnects": self.disconnects, "publish_errors": dict(self.publish_errors),
            "callback_errors": self.callback_errors, "handler_errors": self.handler_errors,
        }
