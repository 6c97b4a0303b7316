"""One hour of steady traffic with a fault every ten minutes: does anything grow, or go missing?

    make soak                                        # 60 min at ~300 msg/s, the goal's shape
    .venv/bin/python bench/soak.py --minutes 6 --fault-every 120   # a short look
    .venv/bin/python bench/soak.py --ingest single   # one ingesting bridge (README: the mode)

The console in production shape, as the fault runs have it (tests/stack.py: private
PostgreSQL, Redis and Mosquitto, stock daphne, celery worker and celery beat), under:
- **tasks**: `POST /api/a2a/send` at `--task-rate` (10/s) to three agents of a simulated node
  (tests/fakenode.py), which ACKs and answers each: a request, its ACK, a TASK_RESPONSE and
  the console's ACK of it, about 40 msg/s;
- **observed traffic** between two other nodes, which the console stores in monitor mode:
  `--observed-rate` (260/s) messages, a TASK_REQUEST and its TASK_RESPONSE each, QoS 1 on a
  persistent session, so a broker restart loses none that the broker acknowledged;
- **10 signed-in `/ws/timeline/` sockets** (`--sockets`), reconnecting as a browser does;
- **a fault every `--fault-every` seconds** (600), in turn: the worker killed with -9,
  Redis, PostgreSQL and the broker restarted, the broker and the database stalled.

Every 10 s it samples, per process (each with its children): resident memory, open file
descriptors and threads; and the connections PostgreSQL and Redis hold. At the end:
- memory, descriptors, threads: for each process and each time it was started (a fault
  restarts the worker), every sample after its first minute against that minute (the
  median of its second; goal for memory: within ±10 %); one that lived under two minutes
  is left out;
- connections PostgreSQL and Redis hold: at the first minute, last, the largest seen;
- lost: every task sent ends final (completed or failed with its reason), every observed
  message the broker acknowledged is a row, and every socket still gets frames.
Figures go to bench/results/soak-<time>.json and are printed as the table docs/soak.md has.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "reachconsole.settings")

import django  # noqa: E402

django.setup()  # the fault runs' helpers import the project's models

import paho.mqtt.client as mqtt  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402

from messages import protocol  # noqa: E402
from tests import test_fault_runs as runs  # noqa: E402
from tests.fakenode import FakeNode  # noqa: E402
from tests.stack import DB_NAME, HOST, Stack, _session_members  # noqa: E402

RESULTS = ROOT / "bench" / "results"
FAULT_ORDER = ("worker-kill", "redis-restart", "postgres-restart", "broker-restart",
               "broker-stall", "postgres-stall")
PROCESSES = ("daphne", "worker", "beat")
SAMPLE_S = 10.0
WARM_S = 120.0  # a process's first two minutes: caches fill, pools open
RSS_GOAL = 0.10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--fault-every", type=float, default=600.0, help="seconds between faults")
    ap.add_argument("--task-rate", type=float, default=10.0, help="tasks sent per second")
    ap.add_argument("--observed-rate", type=float, default=260.0,
                    help="observed messages per second (requests and their responses)")
    ap.add_argument("--sockets", type=int, default=10)
    ap.add_argument("--faults", default=",".join(FAULT_ORDER),
                    help="the faults, in turn (comma-separated; default: all six)")
    ap.add_argument("--ingest", choices=("auto", "shared", "single"), default="auto",
                    help="REACH_BRIDGE_INGEST of the stack's worker (README: single keeps "
                         "observed traffic across a Mosquitto restart)")
    return ap.parse_args(argv)


# --- observed traffic ---------------------------------------------------------------------------
class Observed(threading.Thread):
    """Requests from node-o1 to node-o2 and node-o2's answers, published as the two nodes
    would. `acked`: the message ids the broker acknowledged (PUBACK)."""

    def __init__(self, stack: Stack, prefix: str, rate: float):
        super().__init__(name="soak-observed", daemon=True)
        self.prefix, self.rate = prefix, rate
        self.stop = threading.Event()
        self.acked: set[str] = set()
        self.published = 0
        self.sent_at: list[float] = []  # wall clock of each pair's publish, by seq
        self.errors: Counter = Counter()
        self._ids: dict[int, str] = {}  # mid → message id, until the broker's PUBACK
        self._early: dict[int, bool] = {}
        self._lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                  client_id=f"{prefix}-observed", protocol=mqtt.MQTTv5)
        self.client.max_inflight_messages_set(100)
        self.client.on_publish = self._on_publish
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 3600  # the broker keeps what is in flight across restarts
        self.client.connect_async(HOST, stack.mqtt_port, keepalive=10, clean_start=False,
                                  properties=props)
        self.client.reconnect_delay_set(0.2, 2)
        self.client.loop_start()

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        failed = getattr(reason_code, "is_failure", False)
        with self._lock:
            message_id = self._ids.pop(mid, None)
            if message_id is None:  # acknowledged before run() noted its mid
                self._early[mid] = not failed
            elif not failed:
                self.acked.add(message_id)

    def _envelope(self, seq: int, kind: str) -> tuple[str, bytes]:
        request = kind == "req"
        env = protocol.new_envelope(
            message_type=protocol.MessageType.TASK_REQUEST if request
            else protocol.MessageType.TASK_RESPONSE,
            message_id=f"{self.prefix}-obs-{kind}-{seq:08d}",
            from_agent_id="o1.asker" if request else "o2.doer",
            to_agent_id="o2.doer" if request else "o1.asker",
            target_node_id="node-o2" if request else "node-o1",
            task_id=f"{self.prefix}-obs-{seq:08d}", conversation_id=f"soak-{seq % 50}",
            # A response names its request (PROTOCOL.md), so the console moves the observed
            # request to COMPLETED as it would on a real bus, instead of expiring it.
            headers={"originNodeId": "node-o1" if request else "node-o2",
                     "replyNodeId": "node-o1" if request else "node-o2",
                     **({} if request else {"inReplyTo": f"{self.prefix}-obs-req-{seq:08d}"})},
            payload={"seq": seq} if request else {"result": seq},
        )
        return protocol.inbox_topic(self.prefix, env.target_node_id), protocol.encode(env)

    def run(self) -> None:
        start, seq = time.monotonic(), 0
        while not self.stop.is_set():
            delay = start + self.published / self.rate - time.monotonic()
            if delay > 0:
                self.stop.wait(delay)
                continue
            self.sent_at.append(time.time())
            for kind in ("req", "res"):
                topic, data = self._envelope(seq, kind)
                message_id = f"{self.prefix}-obs-{kind}-{seq:08d}"
                # Not under self._lock: paho's network thread holds its own lock while it
                # calls _on_publish, which takes ours.
                info = self.client.publish(topic, data, qos=1)
                if info.rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                    # NO_CONN: paho keeps it and sends it after the reconnect.
                    with self._lock:
                        early = self._early.pop(info.mid, None)
                        if early is None:
                            self._ids[info.mid] = message_id
                        elif early:
                            self.acked.add(message_id)
                else:
                    self.errors[mqtt.error_string(info.rc)] += 1
                self.published += 1
            seq += 1

    def finish(self, wait_s: float = 60) -> None:
        self.stop.set()
        self.join(10)
        deadline = time.monotonic() + wait_s
        while self._ids and time.monotonic() < deadline:
            time.sleep(0.2)
        self.client.disconnect()
        self.client.loop_stop()


# --- the sockets ---------------------------------------------------------------------------------
class Socket(threading.Thread):
    """One browser's `/ws/timeline/`: frames as they come, and a reconnect after a close (the
    page's htmx socket does the same)."""

    def __init__(self, url: str, cookie: str, origin: str, n: int):
        super().__init__(name=f"soak-ws-{n}", daemon=True)
        self.url, self.cookie, self.origin = url, cookie, origin
        self.frames = 0
        self.last_frame = 0.0
        self.opens = 0
        self.closes: Counter = Counter()
        self.stop = threading.Event()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        import websockets

        while not self.stop.is_set():
            try:
                async with websockets.connect(
                        self.url, origin=self.origin, additional_headers={"Cookie": self.cookie},
                        max_size=None, open_timeout=10) as ws:
                    self.opens += 1
                    while not self.stop.is_set():
                        try:
                            await asyncio.wait_for(ws.recv(), timeout=1.0)
                        except TimeoutError:
                            continue
                        self.frames += 1
                        self.last_frame = time.time()
            except websockets.ConnectionClosed as exc:
                self.closes[str(exc.rcvd.code if exc.rcvd else "no close frame")] += 1
            except (TimeoutError, OSError, websockets.InvalidStatus) as exc:
                self.closes[type(exc).__name__] += 1
            if not self.stop.is_set():
                await asyncio.sleep(1.0)


def session_cookie(stack: Stack) -> str:
    """A viewer signed in on the stack's console, as a browser's cookie (made by a process
    with the console's settings, so the session is the console's own)."""
    code = (
        "import django; django.setup()\n"
        "from django.conf import settings\n"
        "from django.contrib.auth import get_user_model\n"
        "from django.contrib.auth.models import Group\n"
        "from django.test import Client\n"
        "from reachconsole.core.roles import VIEWER\n"
        "user, _ = get_user_model().objects.get_or_create(username='soak-viewer')\n"
        "user.groups.add(Group.objects.get(name=VIEWER))\n"
        "client = Client(); client.force_login(user)\n"
        "print(f'{settings.SESSION_COOKIE_NAME}="
        "{client.cookies[settings.SESSION_COOKIE_NAME].value}')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=stack.env(),
                          capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"signing a viewer in failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


# --- sampling ------------------------------------------------------------------------------------
def _proc_numbers(pid: int) -> tuple[int, int, int]:
    """(RSS kB, open fds, threads) of one process; zeros if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss = next((int(line.split()[1]) for line in status.splitlines()
                    if line.startswith("VmRSS:")), 0)
        threads = next((int(line.split()[1]) for line in status.splitlines()
                        if line.startswith("Threads:")), 0)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return 0, 0, 0
    return rss, fds, threads


def _socket_owners(members: dict[str, list[int]]) -> dict[int, str]:
    """Local TCP port → the process (daphne, worker, beat) whose socket it is: from each
    process's descriptors and the kernel's socket tables."""
    owner_of_inode: dict[str, str] = {}
    for name, pids in members.items():
        for pid in pids:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    owner_of_inode[link[8:-1]] = name
    ports: dict[int, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[9] in owner_of_inode:
                ports[int(fields[1].rsplit(":", 1)[1], 16)] = owner_of_inode[fields[9]]
    return ports


class Sampler(threading.Thread):
    def __init__(self, stack: Stack):
        super().__init__(name="soak-sampler", daemon=True)
        self.stack = stack
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self.started = time.time()

    def one(self) -> dict:
        sample: dict = {"t": round(time.time() - self.started, 1)}
        members: dict[str, list[int]] = {}
        for name in PROCESSES:
            proc = self.stack.procs.get(name)
            if proc is None or proc.poll() is not None:
                sample[name] = None
                continue
            members[name] = _session_members(proc.pid)
            numbers = [_proc_numbers(pid) for pid in members[name]]
            sample[name] = {"pid": proc.pid, "processes": len(members[name]),
                            "rss_kb": sum(n[0] for n in numbers),
                            "fds": sum(n[1] for n in numbers),
                            "threads": sum(n[2] for n in numbers)}
        try:
            with self.stack.connect_db("postgres", timeout=2) as conn:
                # Less this one: the console's own connections.
                sample["pg_connections"] = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s",
                    (DB_NAME,)).fetchone()[0]
        except Exception:
            sample["pg_connections"] = None
        try:
            import redis

            client = redis.Redis(host=HOST, port=self.stack.redis_port, socket_timeout=2)
            sample["redis_clients"] = client.info("clients")["connected_clients"] - 1
            # Whose they are: a count that grows says which process to look at.
            owners = _socket_owners(members)
            by: Counter = Counter()
            for c in client.client_list():
                port = int(str(c.get("addr", ":0")).rsplit(":", 1)[1])
                by[owners.get(port, "other")] += 1
            by["other"] -= 1  # this sampler's own
            sample["redis_by_process"] = dict(by)
            client.close()
        except Exception:
            sample["redis_clients"] = None
        return sample

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append(self.one())
            self.stop.wait(SAMPLE_S)


def lives(samples: list[dict], name: str, key: str) -> list[dict]:
    """`key` (rss_kb, fds, threads) of each run of process `name` (a restart starts another
    pid): at its first minute (the median of its second), then its least, largest and last."""
    runs_: dict[int, list[tuple[float, int]]] = {}
    for s in samples:
        if s.get(name):
            runs_.setdefault(s[name]["pid"], []).append((s["t"], s[name][key]))
    out = []
    for pid, points in runs_.items():
        born = points[0][0]
        second = [v for t, v in points if born + 60 <= t < born + WARM_S]
        later = [v for t, v in points if t >= born + 60]
        if not second or not later:
            continue  # it lived less than two minutes: a fault's victim, not a trend
        out.append({"pid": pid, "at_1min": statistics.median(second), "min": min(later),
                    "max": max(later), "last": later[-1],
                    "minutes": round((points[-1][0] - born) / 60, 1)})
    return out


def memory_verdict(samples: list[dict]) -> dict[str, dict]:
    """Per process and run: every sample after its first minute against that minute."""
    out: dict[str, dict] = {}
    for name in PROCESSES:
        spans, worst = [], 0.0
        for life in lives(samples, name, "rss_kb"):
            low, high = life["min"] / life["at_1min"] - 1, life["max"] / life["at_1min"] - 1
            worst = max(worst, abs(low), abs(high))
            spans.append({"pid": life["pid"], "base_mb": round(life["at_1min"] / 1024, 1),
                          "min_pct": round(100 * low, 1), "max_pct": round(100 * high, 1),
                          "last_mb": round(life["last"] / 1024, 1),
                          "minutes": life["minutes"]})
        out[name] = {"runs": spans, "worst_pct": round(100 * worst, 1),
                     "ok": bool(spans) and worst <= RSS_GOAL}
    return out


def growth(samples: list[dict], key: str) -> dict:
    """A count over the whole run (connections): at the first minute, last, largest."""
    values = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
    if not values:
        return {}
    settled = [v for t, v in values if t >= 60] or [v for _, v in values]
    return {"at_1min": settled[0], "last": values[-1][1], "max": max(v for _, v in values),
            "median": statistics.median(v for _, v in values)}


def fault_at(faults: list[dict], at: float, *, after_s: float) -> str:
    """The fault whose window (from its start to `after_s` after the service was back) holds
    the time `at`: the latest such, where windows overlap (faults closer than `after_s`), so
    that what went wrong is put on the fault it followed."""
    return next((f["fault"] for f in reversed(faults)
                 if f["down_at"] - 0.5 <= at <= f["up_at"] + after_s), "outside any fault")


def missing_when(missing: list[str], sent_at: list[float], faults: list[dict]
                 ) -> dict[str, int]:
    """How many of the messages never stored were published during each fault (from its
    start to 15 s after the service was back), or outside every fault."""
    out: Counter = Counter()
    for message_id in missing:
        seq = int(message_id.rsplit("-", 1)[1])
        at = sent_at[seq] if seq < len(sent_at) else 0.0
        out[fault_at(faults, at, after_s=15)] += 1
    return dict(out)


def failed_when(failed: list, rows: dict[str, dict], faults: list[dict], started: float
                ) -> dict:
    """Where in the run the failed tasks were sent: by minute of the run, by the fault whose
    window (from its start to two minutes after the service was back, a task's longest wait)
    held their first try, and each one's times, so a failure can be read against the faults
    and the stack's logs (REACH_KEEP_STACK=1 keeps them)."""
    by_minute: Counter = Counter()
    by_fault: Counter = Counter()
    each = []
    for sent in failed:
        at = sent.started_at - started
        by_minute[int(at // 60)] += 1
        by_fault[fault_at(faults, sent.started_at, after_s=120)] += 1
        row = rows.get(sent.task_id, {})
        each.append({"task": sent.task_id, "sent_s": round(at, 1),
                     "answered_s": round(sent.answered_at - started, 1)
                     if sent.answered_at else None,
                     "status": row.get("status") or sent.outcome,
                     "error": (row.get("error") or sent.detail or "")[:200]})
    return {"by_minute": dict(sorted(by_minute.items())), "by_fault": dict(by_fault),
            "tasks": each}


# --- the run -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    faults_asked = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults_asked if f not in runs.FAULTS]
    if unknown or not faults_asked:
        raise SystemExit(f"unknown faults {unknown}; known: {', '.join(runs.FAULTS)}")
    # A stopped soak stops its stack too (atexit in tests/stack.py).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stack = Stack(extra_env={"MQTT_KEEPALIVE_S": str(runs.KEEPALIVE_S),
                             "REACH_DB_QUERY_BOUND_S": str(runs.QUERY_BOUND_S),
                             "REACH_BRIDGE_INGEST": args.ingest})
    stack.start()
    prefix = stack.clean_run()
    print(f"soak: console on {stack.base_url}, prefix {prefix}, {args.minutes:g} min, "
          f"a fault every {args.fault_every:g} s, ingest {args.ingest}", flush=True)
    agents = [f"soak.{name}" for name in runs.AGENT_NAMES]
    node = FakeNode(base_url=stack.base_url, token=stack.token, mqtt_host=HOST,
                    mqtt_port=stack.mqtt_port, prefix=prefix, node_id=runs.NODE_ID,
                    agents=agents, heartbeat_s=2.0)
    node.start()
    note = runs.warm_up(stack, agents[0], f"soak-{prefix}")
    if note:
        print(f"soak: {note}", flush=True)
    runs.RATE = args.task_rate  # the fault runs' sender paces itself by this
    total = int(args.minutes * 60 * args.task_rate)
    tasks = [runs.Sent(index=i, task_id=f"soak-{prefix}-{i:06d}", to=agents[i % len(agents)])
             for i in range(total)]
    sender = runs.Sender(stack, tasks, "soak")
    observed = Observed(stack, prefix, args.observed_rate)
    cookie = session_cookie(stack)
    host = stack.base_url.removeprefix("http://")
    sockets = [Socket(f"ws://{host}/ws/timeline/", cookie, stack.base_url, n)
               for n in range(args.sockets)]
    sampler = Sampler(stack)
    faults: list[dict] = []
    started = time.monotonic()
    for piece in (sampler, *sockets, observed, sender):
        piece.start()
    try:
        k = 0
        while time.monotonic() - started < args.minutes * 60:
            next_fault = (k + 0.5) * args.fault_every
            left = min(next_fault, args.minutes * 60) - (time.monotonic() - started)
            if left > 0:
                time.sleep(min(left, 30))
                continue
            if next_fault >= args.minutes * 60 - 60:
                break  # no fault in the last minute: the run ends on a settled console
            fault = faults_asked[k % len(faults_asked)]
            service, _, how = runs.FAULTS[fault]
            print(f"soak: {time.monotonic() - started:6.0f} s  {fault}", flush=True)
            if how == "stall":
                times = stack.stall_service(service, stall_s=runs.STALL_SECONDS[service])
            else:
                times = stack.restart_service(service, down_s=runs.DOWN_S)
            faults.append({"fault": fault, "at_s": round(times["down_at"] - sampler.started),
                           "s": round(times["up_at"] - times["down_at"], 1), **times})
            k += 1
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(1)
    finally:
        # The sender stops after the task under way: those it did not reach are not counted.
        sender.stop.set()
        observed.finish()
        sender.join(runs.CLIENT_RETRY_BUDGET_S + 20)
        sampler.stop.set()

    # The one under way when it stopped too, if it was sent (its outcome says).
    sent_tasks = [t for t in tasks[:sender.progress + 1] if t.outcome != "pending"]
    rows = runs.wait_final(stack, [t.task_id for t in sent_tasks])
    outcome = runs.classify(sent_tasks, rows, node)
    quiet = time.time()
    for socket in sockets:
        socket.stop.set()
    for socket in sockets:
        socket.join(10)
    with stack.connect_db() as conn:
        stored = {r[0] for r in conn.execute(
            "SELECT message_id FROM a2a_message WHERE message_id LIKE %s", (f"{prefix}-obs-%",))}
        # The observed requests' outcomes: each is answered on the bus, so all COMPLETED
        # but those whose response the broker lost (or whose timeoutMs had not passed yet).
        observed_outcomes = dict(conn.execute(
            "SELECT status, count(*) FROM a2a_message WHERE message_id LIKE %s "
            "GROUP BY status", (f"{prefix}-obs-req-%",)).fetchall())
    missing = sorted(observed.acked - stored)
    missing_by_fault = missing_when(missing, observed.sent_at, faults)
    samples = sampler.samples
    report = {
        "minutes": args.minutes, "fault_every_s": args.fault_every, "faults": faults,
        "tasks": {"sent": len(sent_tasks), **{k: len(v) for k, v in outcome.items()},
                  "failed_reasons": Counter(
                      (rows.get(t.task_id, {}).get("error") or t.detail or "?")[:120]
                      for t in outcome["failed"]).most_common(5),
                  "failed_when": failed_when(outcome["failed"], rows, faults,
                                             sampler.started)},
        "observed": {"published": observed.published, "acked": len(observed.acked),
                     "stored_of_acked": len(observed.acked & stored),
                     "missing": missing[:20], "missing_by_fault": missing_by_fault,
                     "request_outcomes": observed_outcomes,
                     "errors": dict(observed.errors)},
        "msg_per_s": round((observed.published + 4 * len(sent_tasks)) / (args.minutes * 60)),
        "sockets": [{"opens": s.opens, "frames": s.frames, "closes": dict(s.closes),
                     "silent_s_at_end": round(quiet - s.last_frame, 1) if s.last_frame
                     else None} for s in sockets],
        "memory": memory_verdict(samples),
        "fds": {name: lives(samples, name, "fds") for name in PROCESSES},
        "threads": {name: lives(samples, name, "threads") for name in PROCESSES},
        "pg_connections": growth(samples, "pg_connections"),
        "redis_clients": growth(samples, "redis_clients"),
        "redis_by_process": {"at_1min": next((s["redis_by_process"] for s in samples
                                              if s["t"] >= 60 and s.get("redis_by_process")),
                                             None),
                             "last": next((s["redis_by_process"] for s in reversed(samples)
                                           if s.get("redis_by_process")), None)},
        "samples": samples,
    }
    node.stop()
    stack.stop()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"soak-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    print_report(report)
    print(f"results: {path.relative_to(ROOT)}")
    lost = (outcome["stuck"] or outcome["twice"] or missing
            or any(s["frames"] == 0 for s in report["sockets"]))
    return 1 if lost or not all(m["ok"] for m in report["memory"].values()) else 0


def print_report(r: dict) -> None:
    t = r["tasks"]
    o = r["observed"]
    print(f"\n{r['minutes']:g} min, ~{r['msg_per_s']} msg/s, faults: "
          + ", ".join(f"{f['fault']} at {f['at_s']} s ({f['s']} s)" for f in r["faults"]))
    print(f"tasks: {t['sent']} sent, {t['completed']} completed, {t['failed']} failed, "
          f"{t['stuck']} stuck, {t['twice']} executed twice; failed: {t['failed_reasons']}")
    if t["failed"]:
        w = t["failed_when"]
        print(f"failed, by when they were sent: {w['by_fault']}; by minute of the run: "
              f"{w['by_minute']}")
    print(f"observed: {o['published']} published, {o['acked']} acknowledged by the broker, "
          f"{o['stored_of_acked']} of those stored; not stored, by when they were published: "
          f"{o['missing_by_fault'] or 'none'}; the first: {o['missing'][:3]}; the requests' "
          f"outcomes: {o['request_outcomes']}")
    frames = [s["frames"] for s in r["sockets"]]
    print(f"sockets: {len(frames)}, frames {min(frames)}–{max(frames)} each, opens "
          f"{sum(s['opens'] for s in r['sockets'])}, closes "
          f"{sum((Counter(s['closes']) for s in r['sockets']), Counter())}")
    print("\n| process | runs (min) | RSS at 1 min, MB | RSS after: least … largest | "
          "fds at 1 min → last (largest) | threads at 1 min → last (largest) |")
    print("| --- | --- | --- | --- | --- | --- |")

    def counts(lives_: list[dict]) -> str:
        return ", ".join(f"{x['at_1min']:g} → {x['last']} ({x['max']})" for x in lives_)

    for name in PROCESSES:
        m = r["memory"][name]
        print(f"| {name} | " + ", ".join(str(x["minutes"]) for x in m["runs"]) + " | "
              + ", ".join(str(x["base_mb"]) for x in m["runs"]) + " | "
              + ", ".join(f"{x['min_pct']:+.1f} … {x['max_pct']:+.1f} %" for x in m["runs"])
              + f" | {counts(r['fds'][name])} | {counts(r['threads'][name])} |")
    print(f"redis clients by process: at 1 min {r['redis_by_process']['at_1min']}, "
          f"last {r['redis_by_process']['last']}")
    for key in ("pg_connections", "redis_clients"):
        g = r[key]
        print(f"{key}: at 1 min {g.get('at_1min')}, last {g.get('last')}, largest "
              f"{g.get('max')}, median {g.get('median')}")


if __name__ == "__main__":
    raise SystemExit(main())
