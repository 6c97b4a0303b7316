"""Backpressure under load: kept in-flight/held counts (messages/backpressure.py), no hot lock.

The goal (from the issue): while 8 clients send 1,500 tasks to one agent (maxInflight 4, a
node that answers at once), completions keep at least half the pace they reach once the sends
stop, and a slot cycle (publish → ACK → release → publish) costs tens of milliseconds, not
hundreds.

What runs, all on 127.0.0.1 (PostgreSQL `reachconsole_bench`, Redis, Mosquitto :1883), under a
fresh topic prefix, channel-layer prefix and cache prefix per run:

- the console side in this process: the real `messages.bridge.Bridge` (claims due outbox rows
  and publishes them, ingests ACK/TASK_RESPONSE, releases held work), the delivery sweep and
  the load reconcile as Celery beat would run them (`--no-sweep` leaves them out), and the
  senders calling `messages.outbound.message_send`, one database connection per thread;
- a fake remote node `node-bp` in a child process (this file with `--fake-node`, so the GIL
  of the console side does not slow it): it answers every TASK_REQUEST at once with ACK then
  TASK_RESPONSE, heartbeats every 2 s listing its agents, and records when each request
  reached it.

Phase A: `--clients` threads send `--tasks` tasks in total to `bench.bp` (maxInflight 4).
  Send latency, completions/s while sends arrive and after they stop (from `finished_at`),
  lock waits in PostgreSQL (sampled from pg_stat_activity every 0.5 s). With `--senders
  process` the sending threads run in a child process (as an API process would), so they do
  not compete with the bridge for this process's GIL.
Phase B1 (the slot cycle): `--chain` tasks to `bench.bp1` (maxInflight 1) in one send, so all
  but the first are held and each ACK releases the next; the cycle is measured between
  consecutive requests reaching the node, and split at the console's ACK (`acked_at`).
Phase B2 (end to end, idle): `--sequential` sends to `bench.bp1`, each awaited.

Bounded: at most 5,000 tasks, 32 clients, and `--budget` seconds (default 170) in all.
Only one run at a time (an advisory lock says so): the agents and their kept counts are shared.

    .venv/bin/python bench/backpressure.py [--strict]   # --strict: exit 2 when a goal is not met
    .venv/bin/python bench/backpressure.py --senders process
    .venv/bin/python bench/backpressure.py --bridge-nodelay   # what TCP_NODELAY would change
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import common

NODE_ID = "node-bp"
CONSOLE = "console"
AGENT_A, AGENT_B = "bench.bp", "bench.bp1"
LIMITS = {AGENT_A: 4, AGENT_B: 1}
HEARTBEAT_S = 2.0
MAX_TASKS, MAX_CLIENTS = 5000, 32
RUN_LOCK = 0x62_70_62_65_6E_63_68  # pg advisory lock key: one backpressure run at a time
TIMEOUT_MS = 600_000
RATIO_GOAL = 0.5
CYCLE_GOAL_MS = 100.0  # "tens of milliseconds, not hundreds": p50 below 100 ms


# --- small helpers -------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of a list of numbers, None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def spread(values: list[float], scale: float = 1000.0) -> dict[str, Any]:
    """p50/p95/p99/max/n of seconds, in milliseconds."""
    out: dict[str, Any] = {"n": len(values)}
    for name, q in (("p50", 50), ("p95", 95), ("p99", 99), ("max", 100)):
        value = pct(values, q)
        out[name] = None if value is None else round(value * scale, 2)
    return out


def ts(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def ms(value: float | None) -> str:
    return common.fmt(value, 1) + " ms" if value is not None else "n/a"


def nodelay(client: Any) -> bool:
    """TCP_NODELAY on a connected paho client's socket (paho 2.x does not set it)."""
    import socket

    sock = client.socket()
    if sock is None:
        return False
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return True


# --- the fake node (child process) ---------------------------------------------------------------
def fake_node_main(prefix: str, out_path: str) -> int:
    """A node that answers at once: ACK then TASK_RESPONSE for every TASK_REQUEST; heartbeats
    every 2 s listing its agents with their maxInflight. Runs until stdin closes."""
    common.project_on_path()
    import paho.mqtt.client as mqtt

    from messages import protocol

    mt = protocol.MessageType
    inbox = protocol.inbox_topic(prefix, NODE_ID)
    received: dict[str, float] = {}  # request message id → when it reached us (epoch s)
    keys: set[str] = set()
    counts: Counter[str] = Counter()
    subscribed = threading.Event()
    stop = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{prefix}-{NODE_ID}",
                         protocol=mqtt.MQTTv5)
    client.max_inflight_messages_set(100)
    client.max_queued_messages_set(0)

    def publish(topic: str, env: Any, qos: int = 1) -> None:
        info = client.publish(topic, protocol.encode(env), qos=qos)
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            counts[f"publish_error:{mqtt.error_string(info.rc)}"] += 1

    def answer(request: Any, kind: Any, payload: Any, **headers: str) -> None:
        env = protocol.new_envelope(
            message_type=kind, from_agent_id=request.to_agent_id or NODE_ID,
            to_agent_id=request.from_agent_id, task_id=request.task_id,
            target_node_id=request.reply_node_id, conversation_id=request.conversation_id,
            headers={"originNodeId": NODE_ID, "replyNodeId": NODE_ID, **headers},
            payload=payload)
        publish(protocol.inbox_topic(prefix, request.reply_node_id), env)
        counts[f"sent:{kind}"] += 1

    def on_connect(c, userdata, flags, reason_code, properties) -> None:
        if not reason_code.is_failure:
            # paho leaves Nagle's algorithm on: our ACK and TASK_RESPONSE, written back to
            # back, would wait for the broker's delayed TCP ACK (~40 ms). A node that answers
            # at once must not add that to the console's figures.
            nodelay(c)
            c.subscribe(inbox, qos=1)

    def on_subscribe(c, userdata, mid, reason_codes, properties) -> None:
        if all(not rc.is_failure for rc in reason_codes):
            subscribed.set()

    def on_message(c, userdata, message) -> None:
        at = time.time()
        try:
            env = protocol.decode(message.payload)
            if isinstance(env, protocol.Rejection):
                counts["rejected"] += 1
                return
            counts[f"received:{env.message_type}"] += 1
            if env.message_type != mt.TASK_REQUEST:
                return  # the console's ACKs of our responses
            if not env.reply_node_id or env.to_agent_id not in LIMITS:
                counts["refused"] += 1
                if env.reply_node_id:
                    answer(env, mt.NACK, {"reason": f"{NODE_ID} hosts no {env.to_agent_id}",
                                          "retryable": False}, ackFor=env.message_id)
                return
            received.setdefault(env.message_id, at)
            duplicate = env.idempotency_key in keys
            keys.add(env.idempotency_key)
            if duplicate:
                counts["duplicates"] += 1
            answer(env, mt.ACK, {"duplicate": True} if duplicate else {},
                   ackFor=env.message_id)
            answer(env, mt.TASK_RESPONSE, {"ok": True, "result": {"echo": env.payload}},
                   inReplyTo=env.message_id)
        except Exception as exc:  # never kill paho's thread
            counts[f"error:{type(exc).__name__}"] += 1

    def heartbeats() -> None:
        while not stop.is_set():
            env = protocol.new_envelope(
                message_type=mt.HEARTBEAT, from_agent_id=NODE_ID,
                headers={"originNodeId": NODE_ID},
                payload={"heartbeatMs": int(HEARTBEAT_S * 1000),
                         "agents": [{"agentId": a, "inflight": 0, "queueDepth": 0,
                                     "maxInflight": m} for a, m in LIMITS.items()]})
            publish(protocol.heartbeat_topic(prefix, NODE_ID), env, qos=0)
            counts["heartbeats"] += 1
            stop.wait(HEARTBEAT_S)

    client.on_connect = on_connect
    client.on_subscribe = on_subscribe
    client.on_message = on_message
    client.connect(common.HOST, common.MQTT_PORT, keepalive=30, clean_start=True)
    client.loop_start()
    if not subscribed.wait(15):
        print("NOT SUBSCRIBED", flush=True)
        return 1
    beat = threading.Thread(target=heartbeats, name="beat", daemon=True)
    beat.start()
    print("READY", flush=True)
    # Until the parent closes our stdin (or dies): bounded anyway.
    waiter = threading.Thread(target=sys.stdin.read, daemon=True)
    waiter.start()
    waiter.join(600)
    stop.set()
    time.sleep(0.2)
    client.disconnect()
    client.loop_stop()
    Path(out_path).write_text(json.dumps({"counts": dict(counts), "received": received}),
                              encoding="utf-8")
    return 0


class FakeNodeProcess:
    def __init__(self, prefix: str):
        self.prefix = prefix
        handle, self.out = tempfile.mkstemp(prefix="bp-node-", suffix=".json")
        os.close(handle)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--fake-node", self.prefix,
             "--fake-node-out", self.out],
            cwd=common.ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(20)
        if not line or line[0].strip() != "READY":
            self.proc.kill()
            raise RuntimeError(f"the fake node did not start: {line!r}")

    def stop(self) -> dict[str, Any]:
        if self.proc is None:
            return {}
        try:
            self.proc.stdin.close()
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        try:
            return json.loads(Path(self.out).read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            return {}
        finally:
            Path(self.out).unlink(missing_ok=True)


# --- instrumentation of the bridge (this process only; no application code changes) --------------
class Timers:
    """Wall time spent in the bridge owner's steps, per phase."""

    METHODS = ("_take", "_ingest", "_confirm", "_publish_due", "_publish", "_report_hearing",
               "_heartbeat")

    def __init__(self, bridge: Any):
        self.lock = threading.Lock()
        self.data: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])
        # While tracing: every step as (name, start, end) in epoch seconds, and when each
        # task request was handed to paho (message id → epoch seconds).
        self.trace: list[tuple[str, float, float]] | None = None
        self.handed: dict[str, float] = {}
        for name in self.METHODS:
            self._wrap(bridge, name)

    def _wrap(self, obj: Any, name: str) -> None:
        original = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            wall = time.time()
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                took = time.perf_counter() - started
                items = args[0] if args and isinstance(args[0], list) else []
                with self.lock:
                    entry = self.data[name]
                    entry[0] += 1
                    entry[1] += took
                    entry[2] = max(entry[2], took)
                    entry[3] += len(items)
                    if self.trace is not None and name != "_take":
                        self.trace.append((name, wall, wall + took))
                        if name == "_publish":
                            for row in items:
                                if row.message_type == "TASK_REQUEST":
                                    self.handed.setdefault(row.message_id, wall)

        setattr(obj, name, timed)

    def take(self, wall_s: float) -> dict[str, Any]:
        """What each step cost since the last call; `_take` is the owner waiting for work."""
        with self.lock:
            data, self.data = self.data, defaultdict(lambda: [0, 0.0, 0.0, 0])
        out = {name: {"calls": int(c), "total_s": round(t, 3), "max_ms": round(m * 1000, 1),
                      "mean_ms": round(t / c * 1000, 2) if c else None,
                      **({"items": int(n)} if n else {})}
               for name, (c, t, m, n) in sorted(data.items())}
        busy = sum(v["total_s"] for k, v in out.items() if k not in ("_take", "_publish"))
        out["owner_busy_fraction"] = round(busy / wall_s, 3) if wall_s else None
        return out


class LogCount(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"{record.levelname} {record.name}: {record.getMessage()[:140]}"] += 1


# --- database-side observations ------------------------------------------------------------------
def pg() -> Any:
    import psycopg

    return psycopg.connect(host=common.HOST, port=common.PG_PORT, user="postgres",
                           dbname=common.BENCH_DB, autocommit=True, connect_timeout=10)


def deadlocks(conn: Any) -> int:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return int(conn.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = %s",
                            (common.BENCH_DB,)).fetchone()[0])


def commit_probe(conn: Any, n: int = 50) -> dict[str, Any]:
    """What one durable commit costs on this box: a one-row insert into a logged table of
    our own (its commit waits for the WAL flush), n times."""
    conn.execute("CREATE TABLE IF NOT EXISTS bench_commit_probe (x integer)")
    took = []
    for _ in range(n):
        started = time.perf_counter()
        with conn.transaction():
            conn.execute("INSERT INTO bench_commit_probe VALUES (1)")
        took.append(time.perf_counter() - started)
    conn.execute("TRUNCATE bench_commit_probe")
    return spread(took)


def statement_kind(query: str) -> str:
    """'SELECT … FOR UPDATE a2a_agent_load' and the like: the verb, the table, the lock."""
    words = query.replace('"', " ").split()
    verb = words[0].upper() if words else "?"
    tables = [w for w in words if w.startswith(("a2a_", "roster_", "directory_"))]
    table = tables[0].split(".")[0] if tables else "?"
    lock = " FOR UPDATE" if "FOR UPDATE" in query.upper() else ""
    return f"{verb}{lock} {table}"


class Sampler:
    """Every 0.5 s: completed tasks of a conversation, the agent's kept counts, the bridge's
    queue, and how many backends of the bench database wait on a lock (and on which)."""

    def __init__(self, conversation: str, agent_id: str, bridge: Any, every: float = 0.5):
        self.conversation, self.agent_id, self.bridge, self.every = (
            conversation, agent_id, bridge, every)
        self.samples: list[dict[str, Any]] = []
        self.lock_waits: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bp-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def _run(self) -> None:
        from django.db import connection

        from messages.models import AgentLoad, Direction, Message, Status

        conn = pg()
        try:
            while not self.stop.is_set():
                at = time.time()
                completed = (Message.objects.filter(
                    conversation_id=self.conversation, direction=Direction.SEND,
                    message_type="TASK_REQUEST", status=Status.COMPLETED)
                    .values("task_id").distinct().count())
                load = AgentLoad.objects.filter(agent_id=self.agent_id).values(
                    "inflight", "held").first() or {}
                # Who waits for a lock, and in which statement (its first words).
                waits = conn.execute(
                    "SELECT wait_event, regexp_replace(left(query, 300), '\\s+', ' ', 'g'), "
                    "count(*) FROM pg_stat_activity WHERE datname = %s "
                    "AND wait_event_type = 'Lock' GROUP BY 1, 2", (common.BENCH_DB,)).fetchall()
                for event, query, count in waits:
                    self.lock_waits[f"{event}: {statement_kind(query)}"] += count
                self.samples.append({
                    "t": round(at, 3), "completed": completed,
                    "inflight": load.get("inflight"), "held": load.get("held"),
                    "bridge_queue": self.bridge.stats()["queued"],
                    "lock_waiting": sum(c for _, _, c in waits)})
                self.stop.wait(self.every)
        finally:
            conn.close()
            connection.close()


class Sweeper:
    """The delivery sweep every REACH_RETRY_SWEEP_S and the load reconcile every 30 s, as
    Celery beat runs them in production."""

    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()
        self.reconcile_off: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bp-sweeper", daemon=True)

    def _run(self) -> None:
        from django.conf import settings
        from django.db import close_old_connections, connection

        from messages.backpressure import loads_reconcile
        from messages.sweeps import deliveries_sweep

        next_reconcile = time.monotonic() + 30
        try:
            while not self.stop.wait(settings.REACH_RETRY_SWEEP_S):
                try:
                    close_old_connections()
                    result = deliveries_sweep()
                    for name in ("retrying", "given_up", "attempts", "released", "ended"):
                        self.totals[name] += getattr(result, name)
                    if time.monotonic() >= next_reconcile:
                        next_reconcile = time.monotonic() + 30
                        self.reconcile_off.append(loads_reconcile())
                except Exception as exc:
                    self.errors[f"{type(exc).__name__}: {str(exc)[:160]}"] += 1
        finally:
            connection.close()


# --- set-up --------------------------------------------------------------------------------------
def prepare() -> None:
    """Forget earlier runs' messages to our agents (a crashed run's open rows would hold
    slots), zero their kept counts, (re-)register them on node-bp."""
    from django.db import transaction
    from django.db.models import Q

    from messages.models import AgentLoad, Message
    from roster.services import agent_register

    agents = list(LIMITS)
    with transaction.atomic():
        old = Message.objects.filter(Q(to_agent_id__in=agents) | Q(from_agent_id__in=agents))
        Message.objects.filter(resend_of__in=old).update(resend_of=None)
        old.delete()
        AgentLoad.objects.filter(agent_id__in=agents).update(inflight=0, held=0)
    for agent_id, limit in LIMITS.items():
        agent_register(agent_id=agent_id, node_id=NODE_ID, max_inflight=limit,
                       version="bench", actor="bench")


def wait_routable(instance: str, timeout: float = 20.0) -> None:
    """The console hears the bus (its bridge reported) and both agents resolve to node-bp."""
    from django.utils import timezone

    from directory.resolver import resolve_agent_node
    from roster.hearing import bridges_hearing

    deadline = time.monotonic() + timeout
    why = ""
    while time.monotonic() < deadline:
        hearing = any(h.instance == instance for h in bridges_hearing())
        answers = [resolve_agent_node(to_agent_id=a, now=timezone.now()) for a in LIMITS]
        if hearing and all(r.ok and r.node_id == NODE_ID for r in answers):
            return
        why = f"hearing={hearing}; " + "; ".join(r.reason for r in answers)
        time.sleep(0.25)
    raise RuntimeError(f"the agents did not become routable within {timeout:.0f} s: {why}")


def session_discard(client_id: str) -> None:
    """The bridge keeps a persistent session (expiry 1 h): end ours on the broker."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    done = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                         protocol=mqtt.MQTTv5)
    client.on_connect = lambda *a: done.set()
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 0
    try:
        client.connect(common.HOST, common.MQTT_PORT, keepalive=10, clean_start=True,
                       properties=props)
        client.loop_start()
        done.wait(5)
        client.disconnect()
        client.loop_stop()
    except OSError:
        pass


def wait_completed(conversation: str, count: int, deadline: float) -> int:
    """Poll until `count` tasks of the conversation are COMPLETED or the deadline passes."""
    from messages.models import Direction, Message, Status

    done = 0
    while time.monotonic() < deadline:
        done = (Message.objects.filter(conversation_id=conversation, direction=Direction.SEND,
                                       message_type="TASK_REQUEST", status=Status.COMPLETED)
                .values("task_id").distinct().count())
        if done >= count:
            break
        time.sleep(0.1)
    return done


def request_rows(conversation: str) -> list[dict[str, Any]]:
    from messages.models import Direction, Message

    return list(Message.objects.filter(conversation_id=conversation, direction=Direction.SEND,
                                       message_type="TASK_REQUEST")
                .order_by("id").values("id", "message_id", "task_id", "status", "attempt",
                                       "created_at", "published_at", "acked_at",
                                       "finished_at", "error"))


# --- phase A: 8 clients, 1,500 tasks -------------------------------------------------------------
class Senders:
    """`clients` threads, each with its own database connection, sending `tasks` tasks in
    all to AGENT_A as fast as each send returns. `go()` starts them together; `join()`
    returns what they saw (latencies in seconds, result statuses, errors)."""

    def __init__(self, *, tasks: int, clients: int, conversation: str, seconds: float):
        self.shares = [tasks // clients + (1 if i < tasks % clients else 0)
                       for i in range(clients)]
        self.conversation, self.seconds = conversation, seconds
        self.barrier = threading.Barrier(clients + 1)
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.statuses: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.start = self.last_send = 0.0
        self.threads = [threading.Thread(target=self._client, args=(i, n), daemon=True,
                                         name=f"bp-send-{i}")
                        for i, n in enumerate(self.shares)]
        for thread in self.threads:
            thread.start()

    def go(self) -> float:
        self.end_by = time.monotonic() + self.seconds
        self.barrier.wait()
        self.start = time.time()
        return self.start

    def _client(self, index: int, count: int) -> None:
        from django.db import connection

        from messages.outbound import SendRequest, message_send

        try:
            self.barrier.wait()
            for n in range(count):
                if time.monotonic() > self.end_by:
                    with self.lock:
                        self.errors["not sent: the send budget ran out"] += count - n
                    return
                started = time.perf_counter()
                try:
                    row = message_send(request=SendRequest(
                        to=AGENT_A, timeout_ms=TIMEOUT_MS, conversation_id=self.conversation,
                        payload={"client": index, "n": n}))
                except Exception as exc:
                    with self.lock:
                        self.errors[f"{type(exc).__name__}: {str(exc)[:160]}"] += 1
                    continue
                took = time.perf_counter() - started
                with self.lock:
                    self.latencies.append(took)
                    self.statuses[f"{row.status}{' (held)' if row.held else ''}"] += 1
                    self.last_send = max(self.last_send, time.time())
        finally:
            connection.close()

    def join(self) -> dict[str, Any]:
        for thread in self.threads:
            thread.join(max(1.0, self.end_by - time.monotonic() + 30))
        return {"start": self.start, "last_send": self.last_send or time.time(),
                "latencies": self.latencies, "statuses": dict(self.statuses),
                "errors": dict(self.errors)}


def sender_child_main(args: argparse.Namespace) -> int:
    """`--senders process`: the senders in a process of their own, as an API process would
    be, so they do not share the bridge's GIL. Waits for GO on stdin, prints one JSON line."""
    os.environ["REACH_DB_POOL_MAX"] = str(args.clients + 4)
    common.django_setup(channel_prefix=args.sender_child, topic_prefix=args.sender_child,
                        node_id=CONSOLE)
    senders = Senders(tasks=args.tasks, clients=args.clients, conversation=args.conversation,
                      seconds=args.send_cap)
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        return 1
    senders.go()
    print(json.dumps(senders.join()), flush=True)
    return 0


class SenderProcess:
    def __init__(self, args: argparse.Namespace, tag: str, conversation: str, seconds: float):
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--sender-child", tag,
             "--conversation", conversation, "--tasks", str(args.tasks),
             "--clients", str(args.clients), "--send-cap", str(seconds)],
            cwd=common.ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if line != "READY":
            self.proc.kill()
            raise RuntimeError(f"the sender process did not start: {line!r}")

    def go(self) -> float:
        self.proc.stdin.write("GO\n")
        self.proc.stdin.flush()
        return time.time()

    def join(self) -> dict[str, Any]:
        out, _ = self.proc.communicate(timeout=240)
        return json.loads(out.strip().splitlines()[-1])


def phase_a(args: argparse.Namespace, tag: str, conversation: str, bridge: Any,
            timers: Timers, deadline: float) -> dict[str, Any]:
    seconds = max(5.0, min(deadline - 45 - time.monotonic(), args.send_cap))
    senders: Senders | SenderProcess
    if args.senders == "process":
        senders = SenderProcess(args, tag, conversation, seconds)
    else:
        senders = Senders(tasks=args.tasks, clients=args.clients, conversation=conversation,
                          seconds=seconds)
    cpu_before = common.cpu_snapshot()
    with Sampler(conversation, AGENT_A, bridge) as sampler:
        start = senders.go()
        timers.take(0)
        sent = senders.join()
        start = sent["start"] or start
        sends_end = sent["last_send"]
        sends_timers = timers.take(sends_end - start)
        cpu_sending = common.cpu_delta(cpu_before, common.cpu_snapshot())
        statuses = Counter(sent["statuses"])
        accepted = sum(n for s, n in statuses.items() if s.startswith("SENT"))
        completed = wait_completed(conversation, accepted, deadline - 35)
        drained = time.time()
        drain_timers = timers.take(drained - sends_end)
    cpu = common.cpu_delta(cpu_before, common.cpu_snapshot())
    rows = request_rows(conversation)
    return analyse_a(args, rows, start=start, sends_end=sends_end, drained=drained,
                     latencies=sent["latencies"], statuses=statuses,
                     errors=Counter(sent["errors"]), accepted=accepted, completed=completed,
                     samples=sampler.samples, lock_waits=sampler.lock_waits,
                     timers={"while_sending": sends_timers, "after_sends": drain_timers},
                     cpu={"while_sending": cpu_sending, "whole_phase": cpu})


def analyse_a(args: argparse.Namespace, rows: list[dict[str, Any]], *, start: float,
              sends_end: float, drained: float, latencies: list[float], statuses: Counter,
              errors: Counter, accepted: int, completed: int, samples: list[dict[str, Any]],
              lock_waits: Counter, timers: dict[str, Any], cpu: dict[str, float]
              ) -> dict[str, Any]:
    finished: dict[str, float] = {}
    by_status: Counter[str] = Counter()
    for row in rows:
        by_status[row["status"]] += 1
        if row["status"] == "COMPLETED" and row["finished_at"]:
            at = row["finished_at"].timestamp()
            finished[row["task_id"]] = min(at, finished.get(row["task_id"], at))
    times = sorted(finished.values())
    during = sum(1 for t in times if t <= sends_end)
    after = len(times) - during
    send_window = max(sends_end - start, 1e-6)
    rate_during = during / send_window
    backlog_at_end = accepted - during
    rate_after = None
    if after:
        rate_after = after / max(times[-1] - sends_end, 1e-6)
    ratio = rate_during / rate_after if rate_after else None
    # Without a backlog when the sends stopped, completions kept pace with the sends.
    kept_up = backlog_at_end <= args.clients * LIMITS[AGENT_A]
    met = (ratio is not None and ratio >= RATIO_GOAL) or (ratio is None and kept_up
                                                          and completed >= accepted)
    requests = [r for r in rows if r["published_at"] and r["acked_at"]]
    return {
        "tasks": args.tasks, "clients": args.clients, "accepted": accepted,
        "send_results": dict(statuses), "send_errors": dict(errors),
        "final_statuses": dict(by_status),
        "retransmissions": sum(1 for r in rows if r["attempt"] > 1),
        "completed": len(times), "all_completed": completed >= accepted and not errors,
        "send_latency_ms": spread(latencies),
        "send_window_s": round(send_window, 2),
        "sends_per_s": round(len(latencies) / send_window, 1),
        "completed_while_sending": during, "backlog_when_sends_stopped": backlog_at_end,
        "completions_per_s_while_sending": round(rate_during, 1),
        "completions_per_s_after": None if rate_after is None else round(rate_after, 1),
        "after_window_s": round(times[-1] - sends_end, 2) if after else 0.0,
        "drain_wait_s": round(drained - sends_end, 2),
        "ratio": None if ratio is None else round(ratio, 3), "ratio_goal": RATIO_GOAL,
        "met": met,
        "held_ms": spread([(r["published_at"] - r["created_at"]).total_seconds()
                           for r in requests]),
        # published_at is stamped when the bridge's owner handles the PUBACK; under load
        # that is often after the ACK was stored, hence negative values.
        "publish_to_ack_ms": spread([(r["acked_at"] - r["published_at"]).total_seconds()
                                     for r in requests]),
        "acked_before_published_at": sum(1 for r in requests
                                         if r["acked_at"] < r["published_at"]),
        "lock_waits_sampled": dict(lock_waits),
        "max_lock_waiting_backends": max((s["lock_waiting"] for s in samples), default=0),
        "max_bridge_queue": max((s["bridge_queue"] for s in samples), default=0),
        "max_held": max((s["held"] or 0 for s in samples), default=0),
        "bridge_timers": timers, "cpu_s": cpu,
        "timeline": [{**s, "t": round(s["t"] - start, 2)} for s in samples],
    }


# --- phase B: the slot cycle, and end to end on an idle agent ------------------------------------
def phase_b_chain(args: argparse.Namespace, conversation: str, timers: Timers,
                  deadline: float) -> dict[str, Any]:
    from messages.outbound import SendRequest, messages_send

    timers.take(0)
    timers.trace, timers.handed = [], {}
    cpu_before = common.cpu_snapshot()
    started = time.time()
    sent = messages_send(requests=[
        SendRequest(to=AGENT_B, timeout_ms=TIMEOUT_MS, conversation_id=conversation,
                    payload={"n": n}) for n in range(args.chain)])
    held = sum(1 for r in sent.rows if r.held)
    completed = wait_completed(conversation, args.chain, min(deadline - 15,
                                                             time.monotonic() + args.chain_cap))
    wall = time.time() - started
    trace, handed = timers.trace, timers.handed
    timers.trace = None
    return {"tasks": args.chain, "held_at_send": held, "completed": completed,
            "wall_s": round(wall, 2), "bridge_timers": timers.take(wall),
            "cpu_s": common.cpu_delta(cpu_before, common.cpu_snapshot()),
            "rows": request_rows(conversation), "trace": trace, "handed": handed}


def _ingest_end(trace: list[tuple[str, float, float]], at: float) -> float | None:
    """The end (commit) of the bridge's ingest call that stamped `at` (its `now`)."""
    for name, start, end in trace:
        if name == "_ingest" and start - 0.001 <= at <= end:
            return end
    return None


def _between(trace: list[tuple[str, float, float]], start: float, end: float) -> Counter:
    """Owner time per step inside [start, end]."""
    spent: Counter[str] = Counter()
    for name, a, b in trace:
        if name != "_publish" and a >= start and b <= end:
            spent[name] += b - a
    return spent


def analyse_chain(chain: dict[str, Any], node_seen: dict[str, float]) -> dict[str, Any]:
    rows = [r for r in chain.pop("rows") if r["attempt"] == 1]
    trace, handed = chain.pop("trace") or [], chain.pop("handed") or {}
    cycle, node_to_ack, ack_to_node, ack_to_pub, pub_to_ack, pub_to_pub = ([] for _ in range(6))
    ack_txn, commit_to_handed, handed_to_node = [], [], []
    owner_in_gap: Counter[str] = Counter()
    for prev, nxt in zip(rows, rows[1:], strict=False):
        seen_prev, seen_next = node_seen.get(prev["message_id"]), node_seen.get(nxt["message_id"])
        acked = ts(prev["acked_at"])
        given = handed.get(nxt["message_id"])
        if seen_prev and seen_next:
            cycle.append(seen_next - seen_prev)
        if seen_prev and acked:
            node_to_ack.append(acked - seen_prev)
        if acked and seen_next:
            ack_to_node.append(seen_next - acked)
        committed = _ingest_end(trace, acked) if acked else None
        if committed and given and seen_next:
            ack_txn.append(committed - acked)
            commit_to_handed.append(given - committed)
            handed_to_node.append(seen_next - given)
            owner_in_gap.update(_between(trace, committed, given))
        if acked and nxt["published_at"]:
            ack_to_pub.append(ts(nxt["published_at"]) - acked)
        if prev["published_at"] and acked:
            pub_to_ack.append(acked - ts(prev["published_at"]))
        if prev["published_at"] and nxt["published_at"]:
            pub_to_pub.append(ts(nxt["published_at"]) - ts(prev["published_at"]))
    p50 = pct(cycle, 50)
    return {
        **chain,
        "cycle_node_ms": spread(cycle),
        "node_to_console_ack_ms": spread(node_to_ack),
        "console_ack_to_next_on_node_ms": spread(ack_to_node),
        # console_ack_to_next_on_node = ack_ingest_txn + commit_to_handed + handed_to_node
        "ack_ingest_txn_ms": spread(ack_txn),
        "ingest_commit_to_next_handed_to_paho_ms": spread(commit_to_handed),
        "handed_to_paho_to_on_node_ms": spread(handed_to_node),
        "owner_between_commit_and_handed_mean_ms": {
            k: round(v / max(len(commit_to_handed), 1) * 1000, 2)
            for k, v in owner_in_gap.most_common()},
        "owner_steps_per_cycle_mean_ms": {
            name: round(sum(b - a for n, a, b in trace if n == name)
                        / max(len(cycle), 1) * 1000, 2)
            for name in sorted({n for n, _, _ in trace})},
        "published_to_acked_ms": spread(pub_to_ack),
        "acked_to_next_published_ms": spread(ack_to_pub),
        "published_to_next_published_ms": spread(pub_to_pub),
        "goal_ms": CYCLE_GOAL_MS,
        "met": p50 is not None and p50 * 1000 < CYCLE_GOAL_MS,
        "statuses": dict(Counter(r["status"] for r in rows)),
    }


def phase_b_sequential(args: argparse.Namespace, conversation: str, timers: Timers,
                       deadline: float) -> dict[str, Any]:
    from messages.models import Message, Status
    from messages.outbound import SendRequest, message_send

    timers.take(0)
    end = min(deadline - 5, time.monotonic() + args.sequential_cap)
    client_e2e: list[float] = []
    started = time.time()
    for n in range(args.sequential):
        if time.monotonic() > end:
            break
        t0 = time.perf_counter()
        row = message_send(request=SendRequest(to=AGENT_B, timeout_ms=TIMEOUT_MS,
                                               conversation_id=conversation, payload={"n": n}))
        while time.monotonic() < end:
            status = Message.objects.filter(pk=row.pk).values_list("status", flat=True).first()
            if status == Status.COMPLETED:
                client_e2e.append(time.perf_counter() - t0)
                break
            time.sleep(0.003)
    wall = time.time() - started
    return {"tasks": args.sequential, "completed": len(client_e2e),
            "client_send_to_seen_completed_ms": spread(client_e2e), "wall_s": round(wall, 2),
            "bridge_timers": timers.take(wall), "rows": request_rows(conversation)}


def analyse_sequential(seq: dict[str, Any], node_seen: dict[str, float]) -> dict[str, Any]:
    rows = [r for r in seq.pop("rows") if r["finished_at"] and r["published_at"]
            and r["acked_at"]]

    def span(a: str, b: str) -> list[float]:
        return [(r[b] - r[a]).total_seconds() for r in rows]

    return {
        **seq,
        "created_to_on_node_ms": spread([node_seen[r["message_id"]] - ts(r["created_at"])
                                         for r in rows if r["message_id"] in node_seen]),
        "created_to_published_ms": spread(span("created_at", "published_at")),
        "published_to_acked_ms": spread(span("published_at", "acked_at")),
        "acked_to_completed_ms": spread(span("acked_at", "finished_at")),
        "end_to_end_ms": spread(span("created_at", "finished_at")),
    }


# --- the run -------------------------------------------------------------------------------------
def measure(args: argparse.Namespace, tag: str) -> int:
    from django.conf import settings
    from django.db import connection

    from messages.backpressure import loads_reconcile
    from messages.bridge import Bridge
    from messages.models import AgentLoad
    from reachconsole.core.metrics import counters_snapshot

    began = time.monotonic()
    deadline = began + args.budget
    logs = LogCount()
    logging.getLogger().addHandler(logs)
    guard = pg()
    if not guard.execute("SELECT pg_try_advisory_lock(%s)", (RUN_LOCK,)).fetchone()[0]:
        print("BENCH NOT RUN: another bench/backpressure.py run holds the bench agents",
              file=sys.stderr)
        return 1
    deadlocks_before = deadlocks(guard)
    result: dict[str, Any] = {"load_average_at_start": os.getloadavg(),
                              "commit_probe_ms": commit_probe(guard)}
    prepare()
    node = FakeNodeProcess(tag)
    node.start()
    bridge = Bridge(url=common.MQTT_URL, node_id=CONSOLE, prefix=tag, instance=tag,
                    protocol_version="5")
    timers = Timers(bridge)
    sweeper = None if args.no_sweep else Sweeper()
    node_stats: dict[str, Any] = {}
    try:
        bridge.start()
        if not bridge.wait_connected(10):
            raise RuntimeError(f"the bridge did not connect to {common.MQTT_URL}")
        if args.bridge_nodelay:
            # Measures what TCP_NODELAY on the bridge's socket would change; the bridge itself
            # does not set it (a reconnect would drop it here: fine for a bench run).
            result["bridge_nodelay_set"] = nodelay(bridge.session.client)
        wait_routable(bridge.client_id)
        if sweeper:
            sweeper.thread.start()
        # Warm up: connections, prepared statements, the whole path once per agent.
        from messages.outbound import SendRequest, messages_send

        warm = f"{tag}-warm"
        messages_send(requests=[SendRequest(to=a, timeout_ms=TIMEOUT_MS, conversation_id=warm)
                                for a in (AGENT_A,) * 8 + (AGENT_B,) * 2])
        wait_completed(warm, 10, time.monotonic() + 15)
        print(f"... phase A: {args.clients} clients, {args.tasks} tasks to {AGENT_A} "
              f"(maxInflight {LIMITS[AGENT_A]})", flush=True)
        result["phase_a"] = phase_a(args, tag, f"{tag}-A", bridge, timers, deadline)
        print(f"... phase B1: the slot cycle, {args.chain} tasks held behind {AGENT_B} "
              f"(maxInflight 1)", flush=True)
        chain = phase_b_chain(args, f"{tag}-B1", timers, deadline)
        print(f"... phase B2: {args.sequential} sequential sends to {AGENT_B}", flush=True)
        sequential = phase_b_sequential(args, f"{tag}-B2", timers, deadline)
        time.sleep(0.3)
        result["kept_counts_at_end"] = {
            a: AgentLoad.objects.filter(agent_id=a).values("inflight", "held").first()
            for a in LIMITS}
        result["reconcile_off_at_end"] = loads_reconcile()
    finally:
        if sweeper:
            sweeper.stop.set()
            sweeper.thread.join(10)
        bridge.stop()
        session_discard(bridge.client_id)
        node_stats = node.stop()
    seen = node_stats.get("received", {})
    result["phase_b_slot_cycle"] = analyse_chain(chain, seen)
    result["phase_b_sequential"] = analyse_sequential(sequential, seen)
    time.sleep(1.0)  # backends report their deadlocks to the statistics within a second
    result["deadlocks"] = deadlocks(guard) - deadlocks_before
    guard.close()
    result["fake_node"] = node_stats.get("counts", {})
    result["console_counters"] = {k: v for k, v in counters_snapshot().items() if v}
    result["sweeper"] = ({"totals": dict(sweeper.totals), "errors": dict(sweeper.errors),
                          "reconcile_off": sweeper.reconcile_off} if sweeper else None)
    result["logged_warnings"] = dict(logs.counts.most_common(30))
    result["elapsed_s"] = round(time.monotonic() - began, 1)
    connection.close()
    report(result)
    document = {
        "bench": "backpressure", "at": datetime.now(UTC).isoformat(),
        "machine": common.machine(), "code": common.git_state(),
        "command": " ".join([".venv/bin/python", "bench/backpressure.py", *sys.argv[1:]]),
        "config": {**{k: v for k, v in vars(args).items()
                      if k not in ("fake_node", "fake_node_out", "sender_child",
                                   "conversation")},
                   "topic_prefix": tag, "broker": common.MQTT_URL,
                   "database": common.BENCH_DB, "node": NODE_ID, "limits": LIMITS,
                   "db_pool_max": settings.REACH_DB_POOL_MAX,
                   "outbox_poll_s": settings.REACH_OUTBOX_POLL_S,
                   "retry_sweep_s": settings.REACH_RETRY_SWEEP_S,
                   "ack_timeout_ms": settings.REACH_ACK_TIMEOUT_MS,
                   "queue_limit": settings.REACH_QUEUE_LIMIT},
        "results": result,
    }
    path = common.write_result("backpressure", document)
    print(f"\nresults: {path.relative_to(common.ROOT)}")
    met = result["phase_a"]["met"] and result["phase_b_slot_cycle"]["met"]
    return 2 if args.strict and not met else 0


def _verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def report(r: dict[str, Any]) -> None:
    a, c, s = r["phase_a"], r["phase_b_slot_cycle"], r["phase_b_sequential"]
    lat, cyc = a["send_latency_ms"], c["cycle_node_ms"]
    ratio = a["ratio"]
    rows = [
        ["A: tasks accepted / completed", f"{a['accepted']:,} / {a['completed']:,}", ""],
        ["A: send latency p50 / p95 / p99",
         f"{ms(lat['p50'])} / {ms(lat['p95'])} / {ms(lat['p99'])}", "(was p50 434 ms)"],
        ["A: sends/s (window)", f"{common.fmt(a['sends_per_s'])} ({a['send_window_s']} s)", ""],
        ["A: completions/s while sending", common.fmt(a["completions_per_s_while_sending"]),
         "(was ~4/s)"],
        ["A: completions/s after sends stop", common.fmt(a["completions_per_s_after"]),
         "(was 17-22/s)"],
        ["A: ratio during / after", "n/a (no backlog)" if ratio is None else f"{ratio:.2f}",
         f">= {RATIO_GOAL}: {_verdict(a['met'])}"],
        ["A: publish -> ACK p50 / p99",
         f"{ms(a['publish_to_ack_ms']['p50'])} / {ms(a['publish_to_ack_ms']['p99'])}", ""],
        ["A: max lock-waiting backends", str(a["max_lock_waiting_backends"]), ""],
        ["B1: slot cycle (node sees n -> n+1) p50 / p99",
         f"{ms(cyc['p50'])} / {ms(cyc['p99'])}",
         f"p50 < {CYCLE_GOAL_MS:.0f} ms: {_verdict(c['met'])} (was ~200 ms)"],
        ["B1:   node -> console ACK p50 / p99",
         f"{ms(c['node_to_console_ack_ms']['p50'])} / "
         f"{ms(c['node_to_console_ack_ms']['p99'])}", ""],
        ["B1:   console ACK -> next on node p50 / p99",
         f"{ms(c['console_ack_to_next_on_node_ms']['p50'])} / "
         f"{ms(c['console_ack_to_next_on_node_ms']['p99'])}", ""],
        ["B1:     ACK ingest transaction p50 / p99",
         f"{ms(c['ack_ingest_txn_ms']['p50'])} / {ms(c['ack_ingest_txn_ms']['p99'])}", ""],
        ["B1:     its commit -> next handed to paho p50",
         ms(c["ingest_commit_to_next_handed_to_paho_ms"]["p50"]), ""],
        ["B1:     handed to paho -> on node p50",
         ms(c["handed_to_paho_to_on_node_ms"]["p50"]), ""],
        ["B1:   published_at -> acked_at p50 / p99",
         f"{ms(c['published_to_acked_ms']['p50'])} / {ms(c['published_to_acked_ms']['p99'])}",
         ""],
        ["B1:   acked_at -> next published_at p50 / p99",
         f"{ms(c['acked_to_next_published_ms']['p50'])} / "
         f"{ms(c['acked_to_next_published_ms']['p99'])}", ""],
        ["B2: end to end (created -> completed) p50 / p99",
         f"{ms(s['end_to_end_ms']['p50'])} / {ms(s['end_to_end_ms']['p99'])}", ""],
        ["B2:   created -> on node p50 / p99",
         f"{ms(s['created_to_on_node_ms']['p50'])} / {ms(s['created_to_on_node_ms']['p99'])}",
         ""],
        ["context: one durable commit p50 / p99",
         f"{ms(r['commit_probe_ms']['p50'])} / {ms(r['commit_probe_ms']['p99'])}", ""],
        ["context: load average at start", " ".join(f"{x:.1f}" for x in
                                                    r["load_average_at_start"]), ""],
        ["deadlocks (pg_stat_database delta)", str(r["deadlocks"]), "0"],
        ["send errors", str(sum(a["send_errors"].values())), "0"],
        ["retransmissions (attempt > 1)", str(a["retransmissions"]), "0"],
        ["kept counts off at the end (reconcile)", str(r["reconcile_off_at_end"]), "0"],
    ]
    print()
    print(common.table(["figure", "value", "goal"], rows))
    owner = a["bridge_timers"]["while_sending"]
    print(f"\nbridge owner busy while sending: {owner.get('owner_busy_fraction')}; "
          f"after: {a['bridge_timers']['after_sends'].get('owner_busy_fraction')}; "
          f"slot cycle phase: {c['bridge_timers'].get('owner_busy_fraction')}")
    if r["logged_warnings"]:
        print("logged warnings:", json.dumps(r["logged_warnings"], indent=1)[:1500])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1500)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--chain", type=int, default=200, help="phase B1: tasks held in a chain")
    ap.add_argument("--sequential", type=int, default=100, help="phase B2: awaited sends")
    ap.add_argument("--budget", type=float, default=170.0, help="seconds for everything")
    ap.add_argument("--send-cap", type=float, default=90.0, help="seconds for phase A's sends")
    ap.add_argument("--chain-cap", type=float, default=30.0)
    ap.add_argument("--sequential-cap", type=float, default=15.0)
    ap.add_argument("--senders", choices=("threads", "process"), default="threads",
                    help="phase A's senders: threads of this process (default), or a process "
                         "of their own (no GIL shared with the bridge)")
    ap.add_argument("--bridge-nodelay", action="store_true",
                    help="set TCP_NODELAY on the bridge's MQTT socket (what-if; the bridge "
                         "does not do it itself)")
    ap.add_argument("--no-sweep", action="store_true",
                    help="run neither the delivery sweep nor the load reconcile")
    ap.add_argument("--strict", action="store_true", help="exit 2 when a goal is not met")
    ap.add_argument("--fake-node", metavar="PREFIX", help=argparse.SUPPRESS)
    ap.add_argument("--fake-node-out", help=argparse.SUPPRESS)
    ap.add_argument("--sender-child", metavar="TAG", help=argparse.SUPPRESS)
    ap.add_argument("--conversation", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.fake_node:
        if not (1 <= args.tasks <= MAX_TASKS and 1 <= args.clients <= MAX_CLIENTS):
            ap.error(f"--tasks 1..{MAX_TASKS}, --clients 1..{MAX_CLIENTS}")
        if not (2 <= args.chain <= 1000 and 1 <= args.sequential <= 1000):
            ap.error("--chain 2..1000, --sequential 1..1000")
        args.budget = min(args.budget, 175.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.fake_node:
        return fake_node_main(args.fake_node, args.fake_node_out)
    if args.sender_child:
        return sender_child_main(args)
    import run

    try:
        common.services_check()
        run.migrate()
    except common.ServiceDown as exc:
        print(f"BENCH NOT RUN: {exc}", file=sys.stderr)
        return 1
    tag = common.run_tag("bp")
    # A connection per sender thread, plus the bridge, sampler and sweeper: the stock pool of
    # 8 would make the senders wait for connections instead of for each other.
    os.environ["REACH_DB_POOL_MAX"] = str(args.clients + 8)
    common.django_setup(channel_prefix=tag, topic_prefix=tag, node_id=CONSOLE)
    try:
        return measure(args, tag)
    finally:
        common.redis_cleanup(tag)


if __name__ == "__main__":
    raise SystemExit(main())
