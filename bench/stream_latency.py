"""Publish → WebSocket frame: how soon an open page hears of a message on the bus.

Production shape, against the shared PostgreSQL (bench database), Redis and Mosquitto:
- a stock `daphne reachconsole.asgi:application` and a stock `celery -A reachconsole worker`
  (whose bootstep runs the MQTT bridge), each its own process, as the README runs them;
- a fake node (its own process, bench/publisher.py's client) publishing valid TASK_REQUESTs
  onto other nodes' inboxes at a fixed rate; the console observes them (monitor mode), stores
  a row, and emits `a2a_message` after commit;
- a signed-in WebSocket client on `/ws/timeline/` (a thread here), stamping each frame.

Latency is the frame's arrival minus the publish time of the message its event names (one
clock: everything runs on this machine). Delivered is the fraction of published messages
whose event reached the socket. Goal: p99 < 50 ms at 1,000 msg/s, every event delivered.

    .venv/bin/python bench/stream_latency.py                     # 200, 500, 1,000 msg/s
    .venv/bin/python bench/stream_latency.py --rates 1000 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import common
import run

GOAL_P99_MS = 50.0
GOAL_RATE = 1000
IDLE_S = 3.0  # after the last publish, stop listening this long after the last frame


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="200,500,1000", help="msg/s, comma-separated")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of publishing per rate")
    ap.add_argument("--window", type=int, default=100, help="QoS 1 publishes in flight")
    ap.add_argument("--redis", default=common.REDIS_URL,
                    help="Redis for the channel layer, cache and Celery (default: the benches')")
    ap.add_argument("--strict", action="store_true", help="exit 2 when the goal is not met")
    return ap.parse_args(argv)


# --- the fake node (its own process) --------------------------------------------------------------
def fake_node_main(prefix: str, run: str, messages: int, rate: float, window: int,
                   out: Any) -> None:
    """bench/publisher.py's client, keeping each message's publish time (ms since epoch)."""
    sys.path.insert(0, str(common.BENCH))
    from publisher import Publisher
    from publisher import parse_args as pub_args

    sent: dict[str, float] = {}

    class Stamped(Publisher):
        """Envelopes built before the clock starts: the fake node's own CPU (about 0.8 of a
        core at 1,000 msg/s when building them on the fly) is not the console's, and on two
        cores it would be taken from the console."""

        def __init__(self, args: argparse.Namespace):
            super().__init__(args)
            self.built = [super(Stamped, self).payload(seq, 0.0) for seq in range(messages)]

        def payload(self, seq: int, sent_ms: float) -> tuple[str, bytes]:
            sent[f"{run}-{seq:07d}"] = sent_ms
            return self.built[seq]

    pub = Stamped(pub_args(["--port", str(common.MQTT_PORT), "--prefix", prefix, "--run", run,
                            "--messages", str(messages), "--rate", str(rate),
                            "--window", str(window)]))
    pub.connect()
    summary = pub.run()
    out.put({**summary, "sent": sent})


# --- the page's socket ------------------------------------------------------------------------
class Listener:
    """One signed-in `/ws/timeline/` socket: the arrival time of each message's first
    `a2a_message` event."""

    def __init__(self, url: str, cookie: str, origin: str):
        self.url, self.cookie, self.origin = url, cookie, origin
        self.arrived: dict[str, float] = {}
        # The event's `at` (the row's updated_at: stamped when the bridge began ingesting its
        # batch), splitting the latency into "before ingest" and "ingest to frame".
        self.stamped: dict[str, str] = {}
        self.frames = 0
        self.events = 0
        self.last_frame = 0.0
        self.close_code: int | None = None
        self.opened = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._main, name="bench-ws", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self.opened.wait(20):
            raise RuntimeError(f"no WebSocket on {self.url} within 20 s")

    def stop(self) -> None:
        if self._loop and self._task:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._task = self._loop.create_task(self._listen())
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass

    async def _listen(self) -> None:
        import websockets

        async with websockets.connect(
            self.url, origin=self.origin, additional_headers={"Cookie": self.cookie},
            max_size=None, ping_interval=None,
        ) as ws:
            self.opened.set()
            try:
                async for raw in ws:
                    now = time.time() * 1000
                    self.frames += 1
                    self.last_frame = now
                    for event in json.loads(raw)["events"]:
                        self.events += 1
                        if (event["event"] == "a2a_message"
                                and event["messageId"] not in self.arrived):
                            self.arrived[event["messageId"]] = now
                            self.stamped[event["messageId"]] = event["at"]
            except websockets.ConnectionClosed as exc:
                self.close_code = exc.code


# --- the console's processes ----------------------------------------------------------------
class Console:
    def __init__(self, tag: str, redis_url: str, secret: str):
        self.port = free_port()
        self.env = {
            **os.environ, "DATABASE_URL": common.DATABASE_URL, "REDIS_URL": redis_url,
            "MQTT_URL": common.MQTT_URL, "MQTT_TOPIC_PREFIX": tag,
            "REACH_CHANNEL_PREFIX": tag, "REACH_CONSOLE_ID": tag,
            "REACH_NODE_ID": f"{tag}-console", "REACH_BRIDGE_INSTANCE": tag,
            "DJANGO_SECRET_KEY": secret, "REACH_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
        }
        self.logs = Path(common.RESULTS) / f"stream-{tag}"
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        bindir = Path(sys.executable).parent
        self._spawn("daphne", [str(bindir / "daphne"), "-b", common.HOST, "-p", str(self.port),
                               "reachconsole.asgi:application"])
        self._spawn("worker", [str(bindir / "celery"), "-A", "reachconsole", "worker",
                               "-l", "warning", "-n", f"{self.env['REACH_CONSOLE_ID']}@%h"])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited: {self.tail(name)}")
            try:
                with urllib.request.urlopen(f"http://{common.HOST}:{self.port}/healthz",
                                            timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"daphne did not answer within 60 s: {self.tail('daphne')}")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - the child owns it
        self.procs[name] = subprocess.Popen(argv, cwd=common.ROOT, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of daphne and of the worker (its pool children included)."""
        out = {}
        for name, proc in self.procs.items():
            pids = [proc.pid]
            try:
                children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                pids += [int(c) for c in children]
            except OSError:
                pass
            total = 0.0
            for pid in pids:
                try:
                    total += common._stat_cpu(f"/proc/{pid}/stat")
                except OSError:
                    pass
            out[name] = total
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((common.HOST, 0))
        return sock.getsockname()[1]


def session_cookie() -> str:
    """A signed-in user of the bench database, as a browser's cookie."""
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.test import Client

    from reachconsole.core.roles import VIEWER

    user, _ = get_user_model().objects.get_or_create(username="bench-stream")
    # A viewer: an account in no role may not read the pages or the streams.
    user.groups.add(Group.objects.get(name=VIEWER))
    client = Client()
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"


# --- one rate ------------------------------------------------------------------------------------
@dataclass
class RateResult:
    rate: float
    published: int = 0
    stored: int = 0  # rows the bridge wrote: a message not stored has no event to deliver
    delivered: int = 0
    delivered_fraction: float | None = None
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    # publish → the bridge starts ingesting the batch, and from there → frame (p50/p99)
    to_ingest_p50_ms: float | None = None
    to_ingest_p99_ms: float | None = None
    ingest_to_frame_p50_ms: float | None = None
    ingest_to_frame_p99_ms: float | None = None
    publish_rate: float | None = None
    frames: int = 0
    events_per_frame: float | None = None
    close_code: int | None = None
    cpu_s: dict[str, float] = field(default_factory=dict)


def publish(tag: str, run: str, n: int, rate: float, window: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=fake_node_main, args=(tag, run, n, rate, window, out), daemon=True)
    proc.start()
    try:
        return out.get(timeout=n / max(rate, 1) + 90)
    finally:
        proc.join(10)


def wait_ready(tag: str, listener: Listener, window: int) -> None:
    """The bridge is subscribed once a probe's event reaches the socket."""
    deadline = time.monotonic() + 60
    attempt = 0
    while time.monotonic() < deadline:
        run = f"{tag}probe{attempt}"
        publish(tag, run, 1, 0, window)
        until = time.monotonic() + 2
        while time.monotonic() < until:
            if f"{run}-0000000" in listener.arrived:
                return
            time.sleep(0.05)
        attempt += 1
    raise RuntimeError("no event of a probe reached the socket within 60 s")


def run_rate(tag: str, rate: float, args: argparse.Namespace, listener: Listener,
             console: Console) -> RateResult:
    n = int(rate * args.duration)
    run = f"{tag}r{int(rate)}"
    frames_before = listener.frames
    events_before = listener.events
    cpu_before = {**common.cpu_snapshot(), **console.cpu()}
    pub = publish(tag, run, n, rate, args.window)
    # Wait for the tail: stop once no frame came for IDLE_S.
    while time.time() * 1000 - max(listener.last_frame, pub["last_publish_ms"]) < IDLE_S * 1000:
        time.sleep(0.1)
    cpu = common.cpu_delta(cpu_before, {**common.cpu_snapshot(), **console.cpu()})
    sent: dict[str, float] = pub["sent"]
    latencies = sorted(listener.arrived[m] - t for m, t in sent.items() if m in listener.arrived)
    res = RateResult(rate=rate, published=min(pub["published"], pub["acked"]),
                     delivered=len(latencies), close_code=listener.close_code, cpu_s=cpu)
    res.delivered_fraction = res.delivered / res.published if res.published else None
    from messages.models import Message

    res.stored = Message.objects.filter(message_id__startswith=f"{run}-").count()
    if latencies:
        q = statistics.quantiles(latencies, n=100, method="inclusive")
        res.p50_ms, res.p95_ms, res.p99_ms = q[49], q[94], q[98]
        res.max_ms = latencies[-1]
        before, after = [], []
        for m, t in sent.items():
            if m in listener.arrived:
                at = datetime.fromisoformat(listener.stamped[m]).timestamp() * 1000
                before.append(at - t)
                after.append(listener.arrived[m] - at)
        res.to_ingest_p50_ms, res.to_ingest_p99_ms = percentiles(before)
        res.ingest_to_frame_p50_ms, res.ingest_to_frame_p99_ms = percentiles(after)
    span = (pub["last_publish_ms"] - pub["first_publish_ms"]) / 1000
    res.publish_rate = res.published / span if span > 0 else None
    res.frames = listener.frames - frames_before
    res.events_per_frame = (listener.events - events_before) / res.frames if res.frames else None
    return res


def percentiles(values: list[float]) -> tuple[float | None, float | None]:
    if len(values) < 2:
        return None, None
    q = statistics.quantiles(values, n=100, method="inclusive")
    return q[49], q[98]


def print_table(results: list[RateResult]) -> None:
    headers = ["msg/s", "published", "stored", "delivered", "p50 ms", "p95 ms", "p99 ms", "max ms",
               "→ingest p50/p99", "ingest→frame p50/p99", "frames", "events/frame"]
    rows = [[common.fmt(r.rate, 0), f"{r.published:,}", f"{r.stored:,}",
             "n/a" if r.delivered_fraction is None else f"{r.delivered_fraction:.2%}",
             common.fmt(r.p50_ms), common.fmt(r.p95_ms), common.fmt(r.p99_ms),
             common.fmt(r.max_ms),
             f"{common.fmt(r.to_ingest_p50_ms)}/{common.fmt(r.to_ingest_p99_ms)}",
             f"{common.fmt(r.ingest_to_frame_p50_ms)}/{common.fmt(r.ingest_to_frame_p99_ms)}",
             f"{r.frames:,}", common.fmt(r.events_per_frame)]
            for r in results]
    print()
    print(common.table(headers, rows))
    for r in results:
        wanted = ("daphne", "worker", "postgres", "redis", "mosquitto")
        cpu = ", ".join(f"{k} {r.cpu_s[k]:.1f}" for k in wanted if k in r.cpu_s)
        print(f"CPU s at {r.rate:,.0f} msg/s: {cpu} (services: all their clients)")


def bridge_session_discard(tag: str) -> None:
    """The worker's bridge keeps a persistent session (expiry 1 h): drop it, so Mosquitto
    does not queue for a subscriber that is gone."""
    from ingest import session_discard

    from messages.client_ids import client_id_for

    session_discard(client_id_for(f"{tag}-console", tag))


def rows_delete(tag: str) -> None:
    """Leave the bench database as we found it (the rows of this run only)."""
    from messages.models import Message

    Message.objects.filter(message_id__startswith=tag).delete()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    try:
        common.services_check()
        run.migrate()  # the console's processes need the schema the code expects
    except common.ServiceDown as exc:
        print(f"BENCH NOT RUN: {exc}", file=sys.stderr)
        return 1
    tag = common.run_tag("s")
    secret = secrets.token_urlsafe(32)
    # The same key as the console's processes: the session's auth hash is signed with it.
    os.environ["DJANGO_SECRET_KEY"] = secret
    os.environ["REACH_CONSOLE_ID"] = tag
    common.REDIS_URL = args.redis  # django_setup() and redis_cleanup() use the same Redis
    common.django_setup(channel_prefix=tag, topic_prefix=tag)
    cookie = session_cookie()
    console = Console(tag, args.redis, secret)
    results: list[RateResult] = []
    listener = None
    try:
        console.start()
        listener = Listener(f"ws://{common.HOST}:{console.port}/ws/timeline/", cookie,
                            f"http://{common.HOST}:{console.port}")
        listener.start()
        wait_ready(tag, listener, args.window)
        for rate in rates:
            print(f"... {rate:,.0f} msg/s for {args.duration:.0f} s", flush=True)
            results.append(run_rate(tag, rate, args, listener, console))
    finally:
        if listener:
            listener.stop()
        console.stop()
        bridge_session_discard(tag)
        rows_delete(tag)
        common.redis_cleanup(tag)
    print_table(results)
    at_goal = [r for r in results if r.rate >= GOAL_RATE]
    met = bool(at_goal) and all(
        r.p99_ms is not None and r.p99_ms < GOAL_P99_MS and r.delivered_fraction == 1.0
        for r in at_goal)
    goals = {"p99_ms_below": GOAL_P99_MS, "at_rate": GOAL_RATE, "all_delivered": True,
             "met": met}
    print(f"\ngoal p99 < {GOAL_P99_MS:.0f} ms at {GOAL_RATE:,} msg/s, all delivered: "
          f"{'met' if met else 'NOT met'} (figures depend on what else runs on the machine)")
    path = common.write_result("stream_latency", {
        "bench": "stream_latency", "machine": common.machine(), "code": common.git_state(),
        "config": {**vars(args), "redis": args.redis, "idle_s": IDLE_S},
        "command": " ".join([".venv/bin/python", "bench/stream_latency.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "goals": goals, "results": [asdict(r) for r in results]})
    print(f"results: {path.relative_to(common.ROOT)}")
    if args.strict and not met:
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
