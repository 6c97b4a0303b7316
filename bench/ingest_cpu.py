"""The CPU cost of messages_ingest per row, without MQTT and without a competing publisher.

bench/ingest.py measures the whole path on a box where the publisher, Mosquitto and
PostgreSQL share two cores with the bridge, so its profile's absolute times are stretched by
CPU contention. This calls `messages.inbound.messages_ingest` directly on the same envelopes
(observed TASK_REQUESTs, in batches as the bridge takes them under load) and reports CPU
per row; --profile adds a py-spy breakdown by phase (bench/profile_summary.py).

    .venv/bin/python bench/ingest_cpu.py [--rows 20000] [--batch 500] [--profile]
    .venv/bin/python bench/ingest_cpu.py --ledger --repeat 8   # the numbers' share

--ledger runs the console and the console without its per-bucket numbers (tasks kept: the
"without" of the numbers goal, as bench/ingest.py --ledger has it) in turns, in this one
process, and compares their rows/s: the numbers' cost on the ingest path without the
broker's and the publisher's noise.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import common
import profile_summary


def payloads(prefix: str, run: str, n: int) -> list[tuple[str, bytes]]:
    """The same envelopes as bench/publisher.py sends."""
    from messages import protocol

    out = []
    for seq in range(n):
        node = f"node-{seq % 8}"
        env = protocol.new_envelope(
            message_type=protocol.MessageType.TASK_REQUEST, message_id=f"{run}-{seq:07d}",
            from_agent_id="bench.sender", to_agent_id="bench.worker", target_node_id=node,
            task_id=f"task-{seq}", conversation_id=f"conv-{seq % 100}",
            headers={"originNodeId": "bench-pub", "replyNodeId": "bench-pub"},
            payload={"seq": seq, "sentMs": time.time_ns() / 1e6, "text": "x" * 64})
        out.append((f"{prefix}/node/{node}/inbox", protocol.encode(env)))
    return out


def ingest_all(items: list[tuple[str, bytes]], prefix: str, batch: int) -> dict:
    from messages.inbound import Incoming, messages_ingest

    stored = 0
    wall0, cpu0, proc0 = time.perf_counter(), time.thread_time(), time.process_time()
    for start in range(0, len(items), batch):
        chunk = [Incoming(t, p) for t, p in items[start : start + batch]]
        stored += messages_ingest(batch=chunk, node_id="bench-console", prefix=prefix).stored
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    time.sleep(1.0)  # let the event thread finish sending, so its CPU is counted
    proc = time.process_time() - proc0
    return {"rows": stored, "rows_per_s": stored / wall,
            "ingest_thread_cpu_us_per_row": cpu / stored * 1e6,
            "process_cpu_us_per_row": proc / stored * 1e6}


def ledger_compare(tag: str, args: argparse.Namespace) -> int:
    """Turns of the console and of no-numbers on fresh envelopes, the table emptied before
    each; medians of rows/s and of the ingest thread's CPU a row."""
    import statistics

    from django.db import connection

    from messages.ledger import Ledger

    sides: dict[str, list[dict]] = {"console": [], "no-numbers": []}
    gc.freeze()
    for turn in range(args.repeat):
        order = list(sides) if turn % 2 == 0 else list(reversed(sides))
        for side in order:
            with connection.cursor() as cur:
                cur.execute("TRUNCATE a2a_message, a2a_task, a2a_rollup CASCADE")
            items = payloads(tag, f"{tag}-{turn}-{side}", args.rows)
            Ledger.keep_numbers = side == "console"
            try:
                sides[side].append(ingest_all(items, tag, args.batch))
            finally:
                Ledger.keep_numbers = True
    rows = []
    medians = {}
    for side, runs in sides.items():
        rate = statistics.median(r["rows_per_s"] for r in runs)
        cpu = statistics.median(r["ingest_thread_cpu_us_per_row"] for r in runs)
        medians[side] = rate
        rows.append([side, common.fmt(rate, 0), common.fmt(cpu),
                     " ".join(common.fmt(r["rows_per_s"], 0) for r in runs)])
    print(common.table(["side", "rows/s (median)", "ingest thread CPU us/row", "runs"], rows))
    ratio = medians["console"] / medians["no-numbers"]
    print(f"\nnumbers: console {medians['console']:,.0f} rows/s vs without its per-bucket "
          f"numbers {medians['no-numbers']:,.0f} rows/s = {ratio:.1%} (goal >= 95%)")
    path = common.write_result("ingest-cpu-ledger", {
        "machine": common.machine(), "code": common.git_state(), **vars(args),
        "sides": sides, "ratio": ratio})
    print(f"results: {path.relative_to(common.ROOT)}")
    return 0


def spy_start(out: Path) -> subprocess.Popen | None:
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        print("py-spy is not installed (.venv/bin/pip install py-spy); not profiling")
        return None
    proc = subprocess.Popen(
        [str(spy), "record", "--pid", str(os.getpid()), "--rate",
         str(profile_summary.SAMPLE_HZ), "--format", "raw", "--threads", "--gil",
         "--nonblocking", "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    return proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ledger", action="store_true",
                    help="console and no-numbers in turns; their rows/s compared")
    ap.add_argument("--repeat", type=int, default=6, help="turns of each side with --ledger")
    args = ap.parse_args(argv)
    try:
        common.services_check()
    except common.ServiceDown as exc:
        print(f"BENCH NOT RUN: {exc}", file=sys.stderr)
        return 1
    tag = common.run_tag("c")
    common.django_setup(channel_prefix=tag, topic_prefix=tag, node_id="bench-console")
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("TRUNCATE a2a_message CASCADE")
    if args.ledger:
        return ledger_compare(tag, args)
    items = payloads(tag, tag, args.rows)
    # The bridge never holds 20,000 payloads; without this, every full collection the
    # ingest triggers would rescan them and bill the phase that happened to allocate.
    gc.freeze()
    out = common.RESULTS / f"profile-ingest-cpu-{tag}.txt"
    spy = spy_start(out) if args.profile else None
    result = ingest_all(items, tag, args.batch)
    if spy is not None:
        spy.send_signal(2)
        spy.wait(20)
    with connection.cursor() as cur:
        cur.execute("TRUNCATE a2a_message CASCADE")
    common.redis_cleanup(tag)
    print(common.table(["rows", "rows/s", "ingest thread CPU us/row", "process CPU us/row"],
                       [[f"{result['rows']:,}", common.fmt(result["rows_per_s"], 0),
                         common.fmt(result["ingest_thread_cpu_us_per_row"]),
                         common.fmt(result["process_cpu_us_per_row"])]]))
    if spy is not None:
        print(f"\npy-spy profile {out.relative_to(common.ROOT)}")
        print(profile_summary.report(out, result["rows"], owner="MainThread"))
    from django.conf import settings

    path = common.write_result("ingest-cpu", {
        "machine": common.machine(), "code": common.git_state(), **vars(args),
        "db_options": dict(settings.DATABASES["default"].get("OPTIONS", {})), **result})
    print(f"\nresults: {path.relative_to(common.ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
