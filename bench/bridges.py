"""One bridge vs two: the console's inbound throughput when a second bridge shares the
topics (MQTT 5 shared subscriptions, `$share/{group}/…`; README "Scaling out").

Each bridge is its own process, as in production (`manage.py mqtt_bridge`: the bridge of a
Celery worker without the worker), with its own REACH_BRIDGE_INSTANCE, against the bench
database, the shared Redis and Mosquitto. bench/publisher.py (its own process) sends valid
A2A envelopes, observed in monitor mode; each payload carries its publish time, so the row's
`created_at` (stamped at ingest) gives publish → row latency (bench/ingest.py's measure).

- burst: N messages as fast as Mosquitto takes them; stored msg/s = rows / (first publish
  → last row).
- paced: --rate msg/s for --duration s; publish → row p50 / p99.

The broker is a private Mosquitto with the raised limits of docs/performance.md
(bench/broker.py): with the stock ones it drops most of a burst before any bridge sees it.

One bridge first, then two (the first bridge's session is reused: a bridge of the 2-bridge
run left offline would keep taking its round-robin share on Mosquitto). Sessions are
discarded at the end. On a 2-core machine the two bridges, the publisher, PostgreSQL and
Mosquitto share the cores: read the ratio with that in mind.

    .venv/bin/python bench/bridges.py [--messages 20000] [--rate 1000 --duration 10]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from ingest import (
    db,
    publisher_run,
    rows_measure,
    rows_wait,
    session_discard,
)

NODE = "bench-console"


def bridge_id(tag: str, i: int) -> str:
    """Bridge i's MQTT client id (messages.client_ids.client_id_for, console id `tag`)."""
    from messages.client_ids import client_id_for

    return client_id_for(NODE, f"{tag}-{i}", tag)


def bridges_start(tag: str, count: int, run_dir: Path) -> list[tuple[subprocess.Popen, object]]:
    procs = []
    for i in range(1, count + 1):
        env = {**os.environ, "DATABASE_URL": common.DATABASE_URL, "REDIS_URL": common.REDIS_URL,
               "MQTT_URL": common.MQTT_URL, "MQTT_TOPIC_PREFIX": tag, "REACH_NODE_ID": NODE,
               "REACH_BRIDGE_INSTANCE": f"{tag}-{i}", "REACH_CONSOLE_ID": tag,
               "REACH_CHANNEL_PREFIX": tag, "REACH_LOG_LEVEL": "WARNING",
               "REACH_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1",
               # The payload carries the publish time the latency is measured from.
               "REACH_STORE_OBSERVED_PAYLOADS": "1"}
        log = open(run_dir / f"bridge-{i}.log", "ab")  # noqa: SIM115 - closed in bridges_stop
        proc = subprocess.Popen([sys.executable, "manage.py", "mqtt_bridge"], cwd=common.ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log))
    return procs


def bridges_stop(procs) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    for proc, log in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def bridges_wait(conn, tag: str, count: int, timeout: float = 60) -> None:
    """Until every bridge reports hearing the bus (connected, subscribed, writing)."""
    ids = [bridge_id(tag, i) for i in range(1, count + 1)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (heard,) = conn.execute(
            "SELECT count(*) FROM roster_bushearing WHERE instance = ANY(%s) "
            "AND hearing_since IS NOT NULL AND heard_at > now() - interval '3 seconds'",
            (ids,)).fetchone()
        if heard == count:
            time.sleep(1)  # the SUBACKs trail the first report
            return
        time.sleep(0.2)
    raise RuntimeError(f"{count - heard} of {count} bridges did not come up (logs in the run "
                       "directory)")


def measure(conn, tag: str, count: int, args, run_dir: Path) -> dict:
    procs = bridges_start(tag, count, run_dir)
    try:
        bridges_wait(conn, tag, count)
        out: dict = {"bridges": count}
        run = f"{tag}b{count}"
        pub = publisher_run(tag, run, args.messages, 0.0, args.window)
        stored = rows_wait(conn, "a2a_message", run, args.messages, idle_s=10, cap_s=180)
        m = rows_measure(conn, "a2a_message", run)
        span_s = ((m["last_row_ms"] or 0) - pub["first_publish_ms"]) / 1000
        out["burst"] = {"messages": args.messages, "stored": stored,
                        "stored_per_s": stored / span_s if span_s > 0 else None,
                        "p50_ms": m["p50_ms"], "p99_ms": m["p99_ms"]}
        run = f"{tag}p{count}"
        n = int(args.rate * args.duration)
        publisher_run(tag, run, n, args.rate, args.window)
        stored = rows_wait(conn, "a2a_message", run, n, idle_s=10, cap_s=120)
        m = rows_measure(conn, "a2a_message", run)
        out["paced"] = {"rate": args.rate, "messages": n, "stored": stored,
                        "p50_ms": m["p50_ms"], "p99_ms": m["p99_ms"], "max_ms": m["max_ms"]}
        return out
    finally:
        bridges_stop(procs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--window", type=int, default=100, help="publishes in flight")
    args = ap.parse_args(argv)
    common.project_on_path()
    try:
        common.services_check()
    except common.ServiceDown as exc:
        print(f"BENCH NOT RUN: {exc}", file=sys.stderr)
        return 1
    import broker

    # The machine's Mosquitto keeps stock limits that drop most of a burst (RELIABILITY.md):
    # this measures the bridges, so they get a broker configured as docs/performance.md says.
    with broker.RaisedBroker() as raised:
        common.MQTT_PORT, common.MQTT_URL = raised.port, f"mqtt://{common.HOST}:{raised.port}"
        print(f"private Mosquitto on {common.MQTT_URL} with {broker.RAISED_LIMITS}")
        return run(args)


def run(args: argparse.Namespace) -> int:
    tag = common.run_tag("br")
    # Settings for the functions of bench/ingest.py (its MQTT clients read them); the bridges
    # themselves are separate processes with their own environment.
    common.django_setup(channel_prefix=tag, topic_prefix=tag, node_id=NODE)
    conn = db()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-bridges-") as tmp:
        try:
            for count in (1, 2):
                results.append(measure(conn, tag, count, args, Path(tmp)))
        finally:
            for i in (1, 2):
                session_discard(bridge_id(tag, i))
            conn.execute("DELETE FROM a2a_message WHERE message_id LIKE %s", (f"{tag}%",))
            common.redis_cleanup(tag)
    rows = [[str(r["bridges"]), common.fmt(r["burst"]["stored_per_s"], 0),
             f"{r['burst']['stored']}/{r['burst']['messages']}",
             common.fmt(r["paced"]["p50_ms"]), common.fmt(r["paced"]["p99_ms"]),
             f"{r['paced']['stored']}/{r['paced']['messages']}"] for r in results]
    print(common.table(["bridges", "burst msg/s stored", "burst stored",
                        f"paced {args.rate:.0f}/s p50 ms", "p99 ms", "paced stored"], rows))
    lost = any(r[k]["stored"] < r[k]["messages"] for r in results for k in ("burst", "paced"))
    data = {"machine": common.machine(), "args": vars(args), "results": results,
            "lost": lost, "git": common.git_state()}
    print(f"written: {common.write_result('bridges', data)}")
    return 2 if lost else 0  # bench/run.py: 2 is a goal not met, 1 a bench that broke


if __name__ == "__main__":
    sys.exit(main())
