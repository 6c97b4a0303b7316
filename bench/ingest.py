"""MQTT → PostgreSQL ingest: the console's bridge beside a plain batched-INSERT baseline.

The same publisher (bench/publisher.py, its own process) sends the same messages to both:
valid A2A TASK_REQUESTs on `<prefix>/node/node-<k>/inbox`, which the console observes in
monitor mode (rows with direction OBSERVED). Each payload carries its publish time, so the
stored row's `created_at` (stamped at ingest) gives publish → row latency.

- console:  messages.bridge.Bridge, started as production starts it, in this process.
- baseline: a paho subscriber (auto ack) buffering messages, and a thread that writes them
            into `bench_baseline_message`, shaped like a2a_message. By default the
            strongest plain way there is: every 50 ms, whatever has come (no batch limit),
            COPY the payload text, untouched, into a staging table and extract the columns
            in PostgreSQL with one `INSERT … SELECT … ON CONFLICT (message_id) DO
            NOTHING`: no JSON parsed in Python, nothing validated, one statement per flush.
            `--baseline-sql executemany` or `values` parse the JSON in Python and bind ~22
            parameters a row instead, in batches of 500 messages or 20 ms.

Modes: burst (N messages as fast as Mosquitto takes them) and paced (--rate msg/s for
--duration s). Goal: console ≥ 85 % of the COPY baseline's rows/s, p99 < 100 ms at
1,000 msg/s.

    .venv/bin/python bench/ingest.py                  # burst of 20,000, then paced 1,000/s
    .venv/bin/python bench/ingest.py --rate 1000      # paced only
    .venv/bin/python bench/ingest.py --mode burst --messages 20000 --profile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import common
import paho.mqtt.client as mqtt
import psycopg
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from psycopg.types.json import Jsonb

TABLE_CONSOLE = "a2a_message"
TABLE_BASELINE = "bench_baseline_message"
GOAL_RATIO = 0.85
GOAL_WORKER_CPU_US = 70.0  # CPU per stored row of the stock worker's whole process tree
GOAL_P99_MS = 100.0
GOAL_RATE = 1000
LEDGER_GOAL = 0.95
# The console with parts of its ledger (messages/ledger.py) off: (keep tasks, keep numbers).
LEDGER_SIDES = {"no-numbers": (True, False), "bare": (False, False)}
BASELINE_BATCH = 500
BASELINE_FLUSH_S = 0.020
# The COPY baseline flushes by time alone: one statement for whatever came in 50 ms, however
# many rows (a burst's flushes grow, their round trips do not): the stronger yardstick.
COPY_FLUSH_S = 0.050
MOSQUITTO_LOG = Path("/var/log/mosquitto/mosquitto.log")
broker_log = MOSQUITTO_LOG  # the private broker's own log under --raised-broker
# Columns the baseline fills; the rest take their defaults (NULL), as for an observed row.
BASELINE_COLUMNS = (
    "message_id", "task_id", "idempotency_key", "message_type", "direction", "status",
    "from_agent_id", "to_agent_id", "target_node_id", "origin_node_id", "reply_node_id",
    "conversation_id", "scene_group_id", "session_id", "topic", "headers", "payload", "error",
    "attempt", "in_reply_to", "created_at", "updated_at",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20_000, help="burst size (default 20,000)")
    ap.add_argument("--rate", type=int, default=None,
                    help=f"paced mode at this many msg/s (alone: paced only; default {GOAL_RATE})")
    ap.add_argument("--duration", type=float, default=10.0, help="paced mode length, s")
    ap.add_argument("--mode", choices=("burst", "paced", "all"), default=None,
                    help="default: all, or paced when --rate is given")
    ap.add_argument("--a2a-profile", action="store_true",
                    help="run the stock worker with and without the A2A-over-MQTT profile's "
                         "discovery subscription (REACH_A2A_PROFILE=1 / 0), sides 'worker' "
                         "and 'worker-native', no profile agent on the bus: what hearing "
                         "the second dialect costs a console that has none (goal >= 0.98)")
    ap.add_argument("--only", choices=("console", "baseline", "worker", "worker-native",
                                       *LEDGER_SIDES),
                    default=None, help="run one side only")
    ap.add_argument("--worker", action="store_true",
                    help="also run the console as the stock Celery worker in a process of "
                         "its own, its CPU read from /proc for its whole process tree")
    ap.add_argument("--ledger", action="store_true",
                    help="also run the console with parts of its ledger switched off in this "
                         "process, to measure what keeping them costs against the same run's "
                         "console: side 'no-numbers' keeps tasks but no per-bucket numbers "
                         "(the goal: console >= 95 %% of it), side 'bare' keeps neither")
    ap.add_argument("--baseline-sql", choices=("copy", "executemany", "values"), default="copy",
                    help="baseline's batched write: COPY of the raw text with the columns "
                         "extracted in SQL (default, the strongest), or the JSON parsed in "
                         "Python and bound per row: executemany (pipelined) or one multi-row "
                         "VALUES statement")
    ap.add_argument("--window", type=int, default=20, help="publisher's QoS 1 in-flight window")
    ap.add_argument("--idle", type=float, default=5.0,
                    help="stop waiting for rows after this many s without a new one")
    ap.add_argument("--heartbeat-ms", type=int, default=5000,
                    help="the bridge's heartbeat period (production default 5000; change it "
                         "only to diagnose, e.g. to see the heartbeat's share of the tail)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per side and mode, alternating sides; goals use medians")
    ap.add_argument("--raised-broker", action="store_true",
                    help="run against a private Mosquitto with the limits docs/performance.md "
                         "recommends (bench/broker.py) instead of the stock one on :1883")
    ap.add_argument("--strict", action="store_true", help="exit 2 when a goal is not met")
    ap.add_argument("--keep", action="store_true",
                    help="leave the last run's rows in the tables for a look afterwards")
    ap.add_argument("--profile", action="store_true",
                    help="py-spy each run (its figures are then marked profiled)")
    args = ap.parse_args(argv)
    args.mode = args.mode or ("paced" if args.rate else "all")
    args.rate = args.rate or GOAL_RATE
    return args


# --- the database -----------------------------------------------------------------------------
def db() -> psycopg.Connection:
    """Our own connection for setup and measuring, apart from the one the bridge uses."""
    return psycopg.connect(host=common.HOST, port=common.PG_PORT, user="postgres",
                           dbname=common.BENCH_DB, autocommit=True)


def tables_prepare(conn: psycopg.Connection) -> dict[str, Any]:
    """A fresh baseline table shaped like a2a_message as migrated now (columns, indexes,
    constraints), and the values for required columns the baseline does not set itself."""
    conn.execute(f"DROP TABLE IF EXISTS {TABLE_BASELINE}")
    conn.execute(f"CREATE TABLE {TABLE_BASELINE} (LIKE {TABLE_CONSOLE} INCLUDING ALL)")
    return common.unfilled_required(conn, TABLE_BASELINE, BASELINE_COLUMNS)


def table_truncate(conn: psycopg.Connection, table: str) -> None:
    # CASCADE: a2a_transition references a2a_message. The console's tasks and numbers go
    # with its messages, so every run starts from the same tables.
    kept = ", a2a_task, a2a_rollup" if table == TABLE_CONSOLE else ""
    conn.execute(f"TRUNCATE {table}{kept} CASCADE")


def rows_count(conn: psycopg.Connection, table: str, run: str) -> int:
    return conn.execute(f"SELECT count(*) FROM {table} WHERE message_id LIKE %s",
                        (f"{run}-%",)).fetchone()[0]


def rows_wait(conn: psycopg.Connection, table: str, run: str, want: int,
              idle_s: float, cap_s: float = 45.0) -> int:
    """Wait until every row is in, or none has arrived for idle_s (the rest are lost)."""
    deadline = time.monotonic() + cap_s
    last, last_change = -1, time.monotonic()
    while time.monotonic() < deadline:
        count = rows_count(conn, table, run)
        if count >= want:
            return count
        if count != last:
            last, last_change = count, time.monotonic()
        elif time.monotonic() - last_change > idle_s:
            break
        time.sleep(0.1)
    return rows_count(conn, table, run)


def rows_measure(conn: psycopg.Connection, table: str, run: str) -> dict[str, Any]:
    """Latency from the publish time in the payload to the row's created_at (ingest)."""
    lat = (f"SELECT created_at, extract(epoch FROM created_at) * 1000 "
           f"- (payload->>'sentMs')::float8 AS ms FROM {table} WHERE message_id LIKE %s")
    row = conn.execute(
        f"SELECT count(*), count(DISTINCT created_at), "
        f"extract(epoch FROM max(created_at)) * 1000, "
        f"percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), "
        f"percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), max(ms) FROM ({lat}) t",
        (f"{run}-%",),
    ).fetchone()
    rows, batches, *times = row
    # extract() gives numeric (Decimal): floats from here on.
    last_row_ms, p50, p99, worst = (None if t is None else float(t) for t in times)
    return {"rows": rows, "batches": batches, "last_row_ms": last_row_ms,
            "p50_ms": p50, "p99_ms": p99, "max_ms": worst}


# --- the broker -------------------------------------------------------------------------------
def mqtt_client(client_id: str) -> mqtt.Client:
    # The console's own factory (after django_setup): MQTT_USERNAME / MQTT_PASSWORD apply.
    from messages.mqtt_client import broker_target
    from messages.mqtt_client import mqtt_client as build

    return build(target=broker_target(common.MQTT_URL, protocol="5"), client_id=client_id)


def connect_wait(client: mqtt.Client, *, properties: Properties | None = None,
                 clean_start: bool = True) -> None:
    done = threading.Event()
    client.on_connect = lambda c, u, f, rc, p: done.set()
    client.connect(common.HOST, common.MQTT_PORT, keepalive=30, clean_start=clean_start,
                   properties=properties)
    client.loop_start()
    if not done.wait(10):
        raise RuntimeError(f"no CONNACK from Mosquitto at {common.MQTT_URL}")


def session_discard(client_id: str) -> None:
    """The bridge keeps a persistent session (expiry 1 h); drop ours so Mosquitto does not
    hold a dead bench subscriber's queue after we leave."""
    client = mqtt_client(client_id)
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 0
    connect_wait(client, properties=props, clean_start=True)
    client.disconnect()
    client.loop_stop()


def probe(prefix: str, conn: psycopg.Connection, table: str, tag: str) -> None:
    """One message end to end before measuring: the subscription is in place (a SUBACK may
    trail the CONNACK) and the database path is warm."""
    from messages import protocol

    message_id = f"probe-{tag}"
    env = protocol.new_envelope(message_type="EVENT", message_id=message_id,
                                from_agent_id="bench.sender", payload={"sentMs": 0})
    client = mqtt_client(f"{tag}-probe")
    connect_wait(client)
    topic = f"{prefix}/node/node-probe/inbox"
    # Again every 2 s until it is stored: a subscriber in a process of its own (the worker
    # side) subscribes some seconds after it starts, and what came before is not its.
    deadline = time.monotonic() + 45
    sql = f"SELECT 1 FROM {table} WHERE message_id = %s"
    try:
        while True:
            client.publish(topic, protocol.encode(env), qos=1).wait_for_publish(10)
            again = time.monotonic() + 2
            while time.monotonic() < again:
                if conn.execute(sql, (message_id,)).fetchone():
                    return
                time.sleep(0.05)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the probe message never reached {table}: is the "
                                   "subscriber subscribed and the database writable?")
    finally:
        client.disconnect()
        client.loop_stop()


def log_offset() -> int | None:
    try:
        return broker_log.stat().st_size
    except OSError:
        return None


def log_drops(offset: int | None, client_ids: list[str]) -> int | None:
    """Mosquitto only says "Outgoing messages are being dropped for client X" in its log."""
    if offset is None:
        return None
    try:
        with broker_log.open("rb") as fh:
            fh.seek(offset)
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    return sum(1 for line in text.splitlines()
               if "dropped" in line and any(cid in line for cid in client_ids))


def publisher_run(prefix: str, run: str, messages: int, rate: float, window: int) -> dict:
    cmd = [sys.executable, str(common.BENCH / "publisher.py"), "--port", str(common.MQTT_PORT),
           "--prefix", prefix, "--run", run,
           "--messages", str(messages), "--rate", str(rate), "--window", str(window)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"publisher failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the two subscribers --------------------------------------------------------------------------
class ConsoleSide:
    """The real bridge, as production starts it."""

    table = TABLE_CONSOLE

    def __init__(self, prefix: str, tag: str, heartbeat_ms: int = 5000):
        from messages.bridge import Bridge

        self.bridge = Bridge(url=common.MQTT_URL, node_id="bench-console", prefix=prefix,
                             instance=tag, protocol_version="5", monitor=True,
                             heartbeat_ms=heartbeat_ms)
        self.client_ids = [self.bridge.client_id]
        self.max_queued = 0
        self._sampling = threading.Event()

    def start(self) -> None:
        self.bridge.start()
        if not self.bridge.wait_connected(10):
            raise RuntimeError(f"the bridge did not connect to {common.MQTT_URL}")
        threading.Thread(target=self._sample, name="bench-sampler", daemon=True).start()

    def _sample(self) -> None:
        # How far the owner thread falls behind paho: 0 means it waits on the broker.
        while not self._sampling.is_set():
            self.max_queued = max(self.max_queued, self.bridge.stats()["queued"])
            time.sleep(0.02)

    def stop(self) -> dict[str, Any]:
        self._sampling.set()
        counts = dict(self.bridge.counts)
        self.bridge.stop()
        session_discard(self.bridge.client_id)
        return {"max_owner_queue": self.max_queued, "bridge_counts_since_last_flush": counts}


class WorkerSide:
    """The console as production runs it: the stock `celery -A reachconsole worker` (its
    bridge a bootstep, the default prefork pool beside it), in a process of its own. Its CPU
    is its whole process tree's, read from /proc: what issue 20's goal counts."""

    table = TABLE_CONSOLE

    def __init__(self, prefix: str, tag: str, a2a_profile: bool = True):
        from messages.client_ids import client_id_for

        self.prefix, self.tag = prefix, tag
        self.a2a_profile = a2a_profile
        self.client_ids = [client_id_for("bench-console", tag, tag)]
        self.proc: subprocess.Popen | None = None
        self.log = common.RESULTS / f"worker-{tag}.log"

    def start(self) -> None:
        common.RESULTS.mkdir(exist_ok=True)
        env = {**os.environ, "MQTT_URL": common.MQTT_URL, "MQTT_PROTOCOL": "5",
               "MQTT_TOPIC_PREFIX": self.prefix,
               # A Redis database of its own: a stock worker takes every Celery task queued
               # on its Redis, and the shared one may carry another console's.
               "REDIS_URL": common.WORKER_REDIS_URL,
               "REACH_NODE_ID": "bench-console", "REACH_BRIDGE_INSTANCE": self.tag,
               # Its client id, cache keys and channel-layer prefix: this run's own, and
               # swept from Redis with the rest of the run's keys.
               "REACH_CONSOLE_ID": self.tag, "REACH_CHANNEL_PREFIX": self.tag,
               "REACH_MONITOR": "1", "REACH_LOG_LEVEL": "WARNING",
               "REACH_A2A_PROFILE": "1" if self.a2a_profile else "0"}
        celery = Path(sys.executable).with_name("celery")
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([str(celery), "-A", "reachconsole", "worker",
                                          "-l", "warning"], cwd=common.ROOT, env=env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def cpu_s(self) -> float:
        """CPU seconds of the worker and every process under it (the prefork pool): of
        each live one, what it spent and what its children that ended spent (utime,
        stime, cutime, cstime), so threads and processes that end mid-run still count."""
        assert self.proc is not None
        total = 0.0
        for pid in common.process_tree(self.proc.pid):
            try:
                total += common.stat_cpu_with_children(f"/proc/{pid}/stat")
            except OSError:
                pass  # gone between the listing and the read: its parent counts it now
        return total

    def cpu_by_part(self) -> dict[str, float]:
        """For the breakdown only (cpu_s is the total): CPU seconds of the worker's live
        threads by name, and of each process under it (the prefork pool)."""
        assert self.proc is not None
        out: dict[str, float] = {}
        root = self.proc.pid
        for pid in common.process_tree(root):
            try:
                if pid != root:
                    out[f"pool:{pid}"] = common._stat_cpu(f"/proc/{pid}/stat")
                    continue
                for task in Path(f"/proc/{pid}/task").iterdir():
                    name = (task / "comm").read_text(encoding="ascii", errors="replace")
                    key = f"thread:{name.strip().split('-bench')[0]}"
                    out[key] = out.get(key, 0.0) + common._stat_cpu(str(task / "stat"))
            except OSError:
                pass  # gone between the listing and the read
        return out

    def stop(self) -> dict[str, Any]:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        session_discard(self.client_ids[0])
        common.redis_cleanup(self.tag, url=common.WORKER_REDIS_URL)
        return {"worker_log": str(self.log.relative_to(common.ROOT))}


class BaselineSide:
    """paho (auto ack) → list → one batched write: COPY every 50 ms of whatever came, or
    (executemany, values) one INSERT per 500 messages or 20 ms."""

    table = TABLE_BASELINE

    def __init__(self, prefix: str, tag: str, sql: str = "executemany",
                 extra: dict[str, Any] | None = None):
        self.prefix = prefix
        self.sql = sql
        self.columns = BASELINE_COLUMNS + tuple(extra or {})
        self.extra = tuple((extra or {}).values())
        self.client = mqtt_client(f"{tag}-baseline")
        self.client_ids = [f"{tag}-baseline"]
        self.cond = threading.Condition()
        self.buffer: list[tuple[str, bytes]] = []
        self.stopping = False
        self.conn = db()
        self.staged = False
        self.flusher = threading.Thread(target=self._flush_loop, name="baseline-flusher",
                                        daemon=True)
        self.max_buffer = 0
        self.by_time = sql == "copy"  # see COPY_FLUSH_S

    def start(self) -> None:
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.on_message = self._on_message
        connect_wait(self.client)
        self.client.subscribe(f"{self.prefix}/node/+/inbox", qos=1)
        if not subscribed.wait(10):
            raise RuntimeError("baseline: no SUBACK")
        self.flusher.start()

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        with self.cond:
            self.buffer.append((message.topic, message.payload))
            if len(self.buffer) >= BASELINE_BATCH and not self.by_time:
                self.cond.notify()

    def _flush_loop(self) -> None:
        if self.by_time:
            self._flush_by_time()
            return
        while True:
            with self.cond:
                if len(self.buffer) < BASELINE_BATCH and not self.stopping:
                    self.cond.wait(BASELINE_FLUSH_S)
                batch = self.buffer[:BASELINE_BATCH]
                del self.buffer[:BASELINE_BATCH]
                self.max_buffer = max(self.max_buffer, len(self.buffer))
                if not batch and self.stopping:
                    return
            if batch:
                self._insert(batch)

    def _flush_by_time(self) -> None:
        next_at = time.monotonic() + COPY_FLUSH_S
        while True:
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at + COPY_FLUSH_S, time.monotonic())
            with self.cond:
                batch, self.buffer = self.buffer, []
                self.max_buffer = max(self.max_buffer, len(batch))
                stopping = self.stopping
            if batch:
                self._insert(batch)
            elif stopping:
                return

    def _insert(self, batch: list[tuple[str, bytes]]) -> None:
        now = datetime.now(UTC)
        if self.sql == "copy":
            self._copy(batch, now)
            return
        rows = [r + self.extra for r in (_baseline_row(t, p, now) for t, p in batch) if r]
        if not rows:
            return
        head = f"INSERT INTO {TABLE_BASELINE} ({', '.join(self.columns)}) VALUES "
        one = "(" + ", ".join(["%s"] * len(self.columns)) + ")"
        tail = " ON CONFLICT (message_id) DO NOTHING"
        if self.sql == "values":
            # One statement: psycopg re-parses its thousands of %s on every batch.
            self.conn.execute(head + ", ".join([one] * len(rows)) + tail,
                              [v for row in rows for v in row])
            return
        # One short statement, parsed once, pipelined per row, one transaction per batch.
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.executemany(head + one + tail, rows)

    def _copy(self, batch: list[tuple[str, bytes]], now: datetime) -> None:
        """The raw text in by COPY, the columns out by PostgreSQL: one statement a batch."""
        if not self.staged:
            self.conn.execute(f"CREATE TEMP TABLE {STAGE} (topic text, body text) "
                              "ON COMMIT DELETE ROWS")
            self.staged = True
        with self.conn.transaction(), self.conn.cursor() as cur:
            with cur.copy(f"COPY {STAGE} (topic, body) FROM STDIN") as copy:
                for topic, payload in batch:
                    copy.write_row((topic, payload.decode()))
            cur.execute(_copy_insert_sql(self.columns), (now, now, *self.extra))

    def stop(self) -> dict[str, Any]:
        self.client.disconnect()
        self.client.loop_stop()
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.flusher.join(10)
        self.conn.close()
        return {"max_buffer": self.max_buffer}


STAGE = "bench_baseline_stage"
# The same fields _baseline_row takes from the JSON, taken by PostgreSQL (m = the message).
COPY_COLUMNS_SQL = {
    "message_id": "m->>'messageId'", "task_id": "coalesce(m->>'taskId', '')",
    "idempotency_key": "coalesce(m->'headers'->>'idempotencyKey', m->>'messageId')",
    "message_type": "m->>'messageType'", "direction": "'OBSERVED'", "status": "'OBSERVED'",
    "from_agent_id": "coalesce(m->>'fromAgentId', '')",
    "to_agent_id": "coalesce(m->>'toAgentId', '')",
    "target_node_id": "coalesce(m->>'targetNodeId', '')",
    "origin_node_id": "coalesce(m->'headers'->>'originNodeId', '')",
    "reply_node_id": "coalesce(m->'headers'->>'replyNodeId', '')",
    "conversation_id": "coalesce(m->>'conversationId', '')",
    "scene_group_id": "coalesce(m->>'sceneGroupId', '')",
    "session_id": "coalesce(m->>'sessionId', '')", "topic": "topic",
    "headers": "coalesce(m->'headers', '{}')", "payload": "m->'payload'", "error": "''",
    "attempt": "coalesce((m->'headers'->>'attempt')::int, 1)",
    "in_reply_to": "coalesce(m->'headers'->>'inReplyTo', m->'headers'->>'ackFor', '')",
    "created_at": "%s", "updated_at": "%s",
}


def _copy_insert_sql(columns: tuple[str, ...]) -> str:
    picks = [COPY_COLUMNS_SQL.get(c, "%s") for c in columns]  # extras: bound constants
    return (f"INSERT INTO {TABLE_BASELINE} ({', '.join(columns)}) "
            f"SELECT {', '.join(picks)} FROM (SELECT topic, body::jsonb->'message' AS m "
            f"FROM {STAGE}) s ON CONFLICT (message_id) DO NOTHING")


def _baseline_row(topic: str, payload: bytes, now: datetime) -> tuple | None:
    """The fields of an observed row, straight from the JSON: no validation beyond that."""
    try:
        msg = json.loads(payload)["message"]
        headers = msg.get("headers") or {}
        return (
            msg["messageId"], msg.get("taskId") or "",
            headers.get("idempotencyKey") or msg["messageId"], msg["messageType"],
            "OBSERVED", "OBSERVED", msg.get("fromAgentId") or "", msg.get("toAgentId") or "",
            msg.get("targetNodeId") or "", headers.get("originNodeId") or "",
            headers.get("replyNodeId") or "", msg.get("conversationId") or "",
            msg.get("sceneGroupId") or "", msg.get("sessionId") or "", topic,
            Jsonb(headers), Jsonb(msg.get("payload")), "", headers.get("attempt") or 1,
            headers.get("inReplyTo") or headers.get("ackFor") or "", now, now,
        )
    except (ValueError, KeyError, TypeError):
        return None


# --- one measured run --------------------------------------------------------------------------
@dataclass
class RunResult:
    side: str
    mode: str
    sent: int
    rate_target: float | None
    rows: int = 0
    lost: int = 0
    rows_per_s: float | None = None
    publish_rate: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    avg_batch: float | None = None
    broker_drop_warnings: int | None = None
    cpu_us_per_row: float | None = None  # the subscriber's own threads, harness excluded
    # PostgreSQL's CPU (all its processes: an upper bound on a shared box) and the WAL it
    # wrote, per stored row: what docs/scaling.md sizes a database from.
    pg_cpu_us_per_row: float | None = None
    wal_bytes_per_row: float | None = None
    profiled: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def run_once(side_name: str, mode: str, args: argparse.Namespace, conn: psycopg.Connection,
             prefix: str, tag: str) -> RunResult:
    n = args.messages if mode == "burst" else int(args.rate * args.duration)
    rate = 0.0 if mode == "burst" else float(args.rate)
    letter = {"console": "c", "baseline": "b", "worker": "w", "worker-native": "v",
              "no-numbers": "n", "bare": "x"}[side_name]
    run = f"{tag}{letter}{mode[0]}"
    side = (BaselineSide(prefix, run, args.baseline_sql, args.baseline_extra)
            if side_name == "baseline"
            else WorkerSide(prefix, run, a2a_profile=side_name == "worker")
            if side_name.startswith("worker") else ConsoleSide(prefix, run, args.heartbeat_ms))
    table_truncate(conn, side.table)
    _ledger_keep(*LEDGER_SIDES.get(side_name, (True, True)))
    side.start()
    profiled = args.profile
    try:
        probe(prefix, conn, side.table, run)
        offset = log_offset()
        pid = side.proc.pid if isinstance(side, WorkerSide) else os.getpid()
        spy = profiler_start(run, mode, n, rate, pid) if profiled else None
        cpu_before = common.cpu_snapshot()
        worker = side if isinstance(side, WorkerSide) else None
        tree_before = (worker.cpu_s(), worker.cpu_by_part()) if worker else None
        wal_before = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        pub = publisher_run(prefix, run, n, rate, args.window)
        if spy is not None:
            # Profile the busy part only: what is left after the last publish drains in
            # well under a second, and the idle wait after it would swamp the figures.
            time.sleep(1.0)
            profiler_stop(spy)
        rows_wait(conn, side.table, run, n, args.idle)
        cpu = common.cpu_delta(cpu_before, common.cpu_snapshot())
        wal_bytes = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)",
                                 [wal_before]).fetchone()[0]
        if worker is not None and tree_before is not None:
            cpu[WORKER_TREE] = round(worker.cpu_s() - tree_before[0], 3)
            parts = common.cpu_delta(tree_before[1], worker.cpu_by_part())
            cpu.update({f"worker {k}": v for k, v in parts.items()})
        measured = rows_measure(conn, side.table, run)
        if spy is not None:
            profile_print(spy, side_name, measured["rows"])
    finally:
        extra = side.stop()
        _ledger_keep(True, True)
    cpu["publisher"] = pub.get("cpu_s")
    return _result(side_name, mode, n, rate, pub, measured,
                   log_drops(offset, side.client_ids), profiled,
                   {**extra, "cpu_s": cpu, "wal_bytes": int(wal_bytes)})


def _ledger_keep(tasks: bool, numbers: bool) -> None:
    """The bench's own switch, never the console's: what the bridge does without keeping
    tasks or per-bucket numbers (messages/ledger.py), in this process only."""
    from messages.ledger import Ledger

    Ledger.keep_tasks, Ledger.keep_numbers = tasks, numbers


def _result(side: str, mode: str, n: int, rate: float, pub: dict, m: dict,
            drops: int | None, profiled: bool, extra: dict) -> RunResult:
    # Count what the broker took: a publisher cut short must not show up as "lost".
    sent = min(n, pub["published"], pub["acked"])
    span_s = ((m["last_row_ms"] or 0) - pub["first_publish_ms"]) / 1000
    pub_span_s = (pub["last_publish_ms"] - pub["first_publish_ms"]) / 1000
    if sent < n:
        print(f"  warning: the broker took only {sent:,} of {n:,} messages: {pub['errors']}")
    return RunResult(
        side=side, mode=mode, sent=sent, rate_target=rate or None, rows=m["rows"],
        lost=sent - m["rows"], rows_per_s=m["rows"] / span_s if span_s > 0 else None,
        publish_rate=sent / pub_span_s if pub_span_s > 0 else None,
        p50_ms=m["p50_ms"], p99_ms=m["p99_ms"], max_ms=m["max_ms"],
        avg_batch=m["rows"] / m["batches"] if m["batches"] else None,
        broker_drop_warnings=drops, profiled=profiled,
        cpu_us_per_row=_cpu_per_row(extra.get("cpu_s", {}), m["rows"]),
        pg_cpu_us_per_row=(extra.get("cpu_s", {}).get("postgres", 0) / m["rows"] * 1e6
                           if m["rows"] else None),
        wal_bytes_per_row=extra.get("wal_bytes", 0) / m["rows"] if m["rows"] else None,
        extra={**extra, "publisher_errors": pub["errors"]},
    )


HARNESS_THREADS = ("thread:MainThread", "thread:bench-sampler")


WORKER_TREE = "process_tree:worker"


def _cpu_per_row(cpu: dict[str, float], rows: int) -> float | None:
    """CPU of the subscriber's threads (paho, bridge owner or flusher, events) per row; for
    the worker side, its whole process tree's."""
    if WORKER_TREE in cpu:
        spent = cpu[WORKER_TREE]
    else:
        spent = sum(v for k, v in cpu.items()
                    if k.startswith("thread:") and k not in HARNESS_THREADS)
    return spent / rows * 1e6 if rows else None


# --- profiling ----------------------------------------------------------------------------------
def profiler_start(run: str, mode: str, n: int, rate: float, pid: int
                   ) -> subprocess.Popen | None:
    """py-spy on `pid`: this process (the in-process console, the baseline) or the worker."""
    import profile_summary

    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        print("py-spy is not installed (.venv/bin/pip install py-spy); not profiling")
        return None
    seconds = 40 if not rate else int(n / rate) + 8
    out = common.RESULTS / f"profile-{mode}-{run}.txt"
    common.RESULTS.mkdir(exist_ok=True)
    # --gil: the process is GIL-bound, so what matters is who holds it; --nonblocking:
    # sample without stopping the process, so the profiled run stays close to a plain one.
    cmd = [str(spy), "record", "--pid", str(pid), "--rate", str(profile_summary.SAMPLE_HZ),
           "--duration", str(seconds), "--format", "raw", "--threads", "--gil", "--nonblocking",
           "--output", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy needs a moment to attach
    proc.out_path = out  # type: ignore[attr-defined]
    return proc


def profiler_stop(proc: subprocess.Popen) -> None:
    proc.send_signal(2)  # SIGINT: py-spy writes what it has and exits
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


def profile_print(proc: subprocess.Popen, side: str, rows: int) -> None:
    import profile_summary

    path = proc.out_path  # type: ignore[attr-defined]
    print(f"{side}: py-spy profile {path.relative_to(common.ROOT)}")
    print(profile_summary.report(path, rows))


# --- report ----------------------------------------------------------------------------------
def _median(values: list[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    return statistics.median(known) if known else None


def verdict(results: list[RunResult]) -> dict[str, Any]:
    """Goals on the medians of the unprofiled runs; a lost message fails a goal outright."""
    runs = [r for r in results if not r.profiled]

    def pick(side: str, mode: str) -> list[RunResult]:
        return [r for r in runs if r.side == side and r.mode == mode]

    out: dict[str, Any] = {"goal": f"console >= {GOAL_RATIO:.0%} of baseline rows/s (burst), "
                                   f"p99 < {GOAL_P99_MS:.0f} ms at {GOAL_RATE} msg/s (paced)"}
    con, base = pick("console", "burst"), pick("baseline", "burst")
    con_rate = _median([r.rows_per_s for r in con])
    base_rate = _median([r.rows_per_s for r in base])
    if con_rate and base_rate:
        out.update(console_rows_per_s=con_rate, baseline_rows_per_s=base_rate,
                   throughput_ratio=con_rate / base_rate,
                   console_lost=sum(r.lost for r in con), baseline_lost=sum(r.lost for r in base))
        out["throughput_met"] = con_rate / base_rate >= GOAL_RATIO and out["console_lost"] == 0
    worker = pick("worker", "burst")
    worker_rate = _median([r.rows_per_s for r in worker])
    worker_cpu = _median([r.cpu_us_per_row for r in worker])
    if worker_rate and base_rate and worker_cpu:
        # Issue 20's goal, on the console as production runs it: rows/s against the same
        # baseline, and CPU per stored row of the worker's whole process tree.
        out.update(worker_rows_per_s=worker_rate, worker_ratio=worker_rate / base_rate,
                   worker_cpu_us_per_row=worker_cpu, worker_lost=sum(r.lost for r in worker))
        out["worker_met"] = (worker_rate / base_rate >= GOAL_RATIO
                             and worker_cpu <= GOAL_WORKER_CPU_US and out["worker_lost"] == 0)
    native_rate = _median([r.rows_per_s for r in pick("worker-native", "burst")])
    if worker_rate and native_rate:
        # The second dialect's subscription on a bus without its agents: the goal is that
        # it costs nothing measurable (>= 0.98 of the same worker without it).
        out.update(worker_rows_per_s=worker_rate, worker_native_rows_per_s=native_rate,
                   profile_ratio=worker_rate / native_rate,
                   profile_met=worker_rate / native_rate >= 0.98)
    unnumbered_rate = _median([r.rows_per_s for r in pick("no-numbers", "burst")])
    bare_rate = _median([r.rows_per_s for r in pick("bare", "burst")])
    if con_rate and unnumbered_rate:
        # The goal: ingest with the per-bucket numbers kept >= 95 % of without (tasks kept
        # on both sides).
        out.update(unnumbered_rows_per_s=unnumbered_rate,
                   ledger_ratio=con_rate / unnumbered_rate,
                   ledger_met=con_rate / unnumbered_rate >= LEDGER_GOAL)
    if con_rate and bare_rate:
        # What the whole ledger costs, tasks too (no goal: a task list needs its rows).
        out.update(bare_rows_per_s=bare_rate, bare_ratio=con_rate / bare_rate)
    paced = [r for r in pick("console", "paced") if r.rate_target == GOAL_RATE]
    if paced:
        out["paced_p99_ms"] = _median([r.p99_ms for r in paced])
        out["paced_lost"] = sum(r.lost for r in paced)
        out["latency_met"] = (out["paced_p99_ms"] is not None
                              and out["paced_p99_ms"] < GOAL_P99_MS and out["paced_lost"] == 0)
    return out


def print_report(results: list[RunResult], goals: dict[str, Any]) -> None:
    headers = ["side", "mode", "sent", "stored", "lost", "rows/s", "pub msg/s", "p50 ms",
               "p99 ms", "max ms", "avg batch", "CPU us/row", "PG us/row", "WAL B/row",
               "drop warnings"]
    rows = [[r.side + (" (profiled)" if r.profiled else ""), r.mode + (
        f"@{r.rate_target:.0f}/s" if r.rate_target else ""), f"{r.sent:,}", f"{r.rows:,}",
        f"{r.lost:,}", common.fmt(r.rows_per_s, 0), common.fmt(r.publish_rate, 0),
        common.fmt(r.p50_ms), common.fmt(r.p99_ms), common.fmt(r.max_ms),
        common.fmt(r.avg_batch), common.fmt(r.cpu_us_per_row, 0),
        common.fmt(r.pg_cpu_us_per_row, 0), common.fmt(r.wal_bytes_per_row, 0),
        "n/a" if r.broker_drop_warnings is None
        else str(r.broker_drop_warnings)] for r in results]
    print()
    print(common.table(headers, rows))
    print("\nlost = sent - stored (the publisher had a PUBACK for every message, so the broker "
          "dropped them).\nlatency = publish -> row created_at, stamped when the batch's "
          "ingest starts.\nCPU us/row = the subscriber's threads (paho, owner/flusher, events) "
          "per stored row; for the worker, its whole process tree from /proc.\n"
          "PG us/row, WAL B/row = PostgreSQL's CPU (all its processes) and the WAL it wrote, "
          "per stored row.\n"
          "drop warnings = Mosquitto log lines 'Outgoing messages are being "
          "dropped' for our client (one per episode, not per message).")
    print()
    print("goal:", goals["goal"])
    if "throughput_ratio" in goals:
        print(f"  burst: console {common.fmt(goals['console_rows_per_s'], 0)} rows/s vs "
              f"baseline {common.fmt(goals['baseline_rows_per_s'], 0)} rows/s (medians) = "
              f"{goals['throughput_ratio']:.0%}; messages lost by the console: "
              f"{goals['console_lost']:,} -> {_met(goals['throughput_met'])}")
    if "worker_ratio" in goals:
        print(f"  worker: the stock Celery worker {common.fmt(goals['worker_rows_per_s'], 0)} "
              f"rows/s = {goals['worker_ratio']:.0%} of the baseline (goal >= "
              f"{GOAL_RATIO:.0%}), {common.fmt(goals['worker_cpu_us_per_row'], 0)} us of CPU "
              f"per stored row, its whole process tree (goal <= {GOAL_WORKER_CPU_US:.0f}); "
              f"lost {goals['worker_lost']:,} -> {_met(goals['worker_met'])}")
    if "profile_ratio" in goals:
        print(f"  A2A-over-MQTT: the stock worker hearing the profile's cards "
              f"{common.fmt(goals['worker_rows_per_s'], 0)} rows/s vs without "
              f"{common.fmt(goals['worker_native_rows_per_s'], 0)} rows/s (medians) = "
              f"{goals['profile_ratio']:.3f} (goal >= 0.98) -> {_met(goals['profile_met'])}")
    if "ledger_ratio" in goals:
        print(f"  numbers: console {common.fmt(goals['console_rows_per_s'], 0)} rows/s vs "
              f"without its per-bucket numbers "
              f"{common.fmt(goals['unnumbered_rows_per_s'], 0)} rows/s = "
              f"{goals['ledger_ratio']:.0%} (goal >= {LEDGER_GOAL:.0%}) -> "
              f"{_met(goals['ledger_met'])}")
    if "bare_ratio" in goals:
        print(f"  whole ledger: console vs without tasks or numbers "
              f"{common.fmt(goals['bare_rows_per_s'], 0)} rows/s = {goals['bare_ratio']:.0%} "
              "(no goal; what keeping the task list costs is the rest)")
    if "latency_met" in goals:
        print(f"  paced: console p99 = {common.fmt(goals['paced_p99_ms'])} ms (median), "
              f"lost {goals['paced_lost']:,} -> {_met(goals['latency_met'])}")


def _met(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        common.services_check()
        common.migrate()  # run alone, on a fresh machine too
    except common.ServiceDown as exc:
        print(f"BENCH NOT RUN: {exc}", file=sys.stderr)
        return 1
    if not args.raised_broker:
        return run_all(args)
    import broker

    with broker.RaisedBroker() as raised:
        # Point every client (bridge, baseline, publisher, probe) at the private broker.
        common.MQTT_PORT, common.MQTT_URL = raised.port, f"mqtt://{common.HOST}:{raised.port}"
        global broker_log
        broker_log = raised.log
        print(f"private Mosquitto on {common.MQTT_URL} with {broker.RAISED_LIMITS}")
        return run_all(args)


def run_all(args: argparse.Namespace) -> int:
    tag = common.run_tag("i")
    # The baseline stores every payload; the console stores the same (and the latency
    # is read from the payload's publish time).
    os.environ["REACH_STORE_OBSERVED_PAYLOADS"] = "1"
    common.django_setup(channel_prefix=tag, topic_prefix=tag, node_id="bench-console")
    try:
        return measure(args, tag)
    finally:
        common.redis_cleanup(tag)


def measure(args: argparse.Namespace, tag: str) -> int:
    prefix = tag  # one topic prefix per invocation: no test and no earlier run shares it
    conn = db()
    args.baseline_extra = tables_prepare(conn)
    modes = ["burst", "paced"] if args.mode == "all" else [args.mode]
    results: list[RunResult] = []
    for mode in modes:
        for rep in range(args.repeat):
            sides = [args.only] if args.only else ["console", "baseline"]
            if args.worker and not args.only:
                sides.append("worker")
            if args.a2a_profile and not args.only:
                sides = ["worker", "worker-native"]
            if args.ledger and not args.only:
                sides += list(LEDGER_SIDES)
            # Alternate who goes first: the box's background load drifts over a minute.
            for side in sides if rep % 2 == 0 else sides[::-1]:
                print(f"... {side} {mode} ({rep + 1}/{args.repeat})", flush=True)
                results.append(run_once(side, mode, args, conn, f"{prefix}r{rep}",
                                        f"{tag}r{rep}"))
    if not args.keep:
        for table in (TABLE_CONSOLE, TABLE_BASELINE):
            table_truncate(conn, table)
    goals = verdict(results)
    print_report(results, goals)
    path = common.write_result("ingest", _document(args, prefix, results, goals))
    print(f"\nresults: {path.relative_to(common.ROOT)}")
    unmet = [k for k in ("throughput_met", "latency_met", "ledger_met", "worker_met")
             if goals.get(k) is False]
    return 2 if args.strict and unmet else 0


def _db_options() -> dict[str, Any]:
    # Server-side binding and statement preparing change the insert path's cost.
    from django.conf import settings

    return dict(settings.DATABASES["default"].get("OPTIONS", {}))


def _document(args: argparse.Namespace, prefix: str, results: list[RunResult],
              goals: dict[str, Any]) -> dict[str, Any]:
    return {
        "bench": "ingest", "at": datetime.now(UTC).isoformat(), "machine": common.machine(),
        "code": common.git_state(), "db_options": _db_options(),
        "command": " ".join([".venv/bin/python", "bench/ingest.py", *sys.argv[1:]]),
        "config": {**vars(args), "topic_prefix": prefix, "broker": common.MQTT_URL,
                   "database": common.BENCH_DB, "baseline_batch": (
                       "all in each flush" if args.baseline_sql == "copy" else BASELINE_BATCH),
                   "baseline_flush_ms": (COPY_FLUSH_S if args.baseline_sql == "copy"
                                         else BASELINE_FLUSH_S) * 1000},
        "results": [asdict(r) for r in results], "goals": goals,
    }


if __name__ == "__main__":
    raise SystemExit(main())
