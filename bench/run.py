"""`make bench`: check the services, then bench/resolve.py, layers.py, ingest.py (with the
console's ledger on and off in the same run), backpressure.py, leases.py, roster_pages.py,
stream_latency.py, bridges.py, timeline.py, overview.py, retention.py, payloads.py and
partitions.py.

Each bench runs in its own process (ingest.py sets Django up against the bench database;
layers.py needs no database) and writes its JSON into bench/results/. A service that is not
reachable stops everything before any measuring, with what to do about it.

    .venv/bin/python bench/run.py [--strict]   # --strict: exit 2 when a goal is not met
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import common


def bench(script: str, *args: str) -> int:
    print(f"\n=== {script} {' '.join(args)}".rstrip(), flush=True)
    started = time.monotonic()
    code = subprocess.run([sys.executable, str(common.BENCH / script), *args],
                          cwd=common.ROOT, check=False).returncode
    print(f"=== {script}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strict", action="store_true", help="exit 2 when a goal is not met")
    args = ap.parse_args(argv)
    try:
        common.services_check()
        common.migrate()
    except common.ServiceDown as exc:
        print(f"\nBENCH NOT RUN: {exc}", file=sys.stderr)
        return 1
    print(f"services ok: PostgreSQL ({common.BENCH_DB}), Redis, Mosquitto on {common.HOST}")
    resolve_env = {"DATABASE_URL": common.DATABASE_URL}
    os.environ.update(resolve_env)
    codes = [bench("resolve.py"), bench("layers.py"),
             bench("ingest.py", "--ledger", *(["--strict"] if args.strict else []))]
    codes.append(bench("backpressure.py", *(["--strict"] if args.strict else [])))
    codes.append(bench("leases.py", *(["--strict"] if args.strict else [])))
    codes.append(bench("roster_pages.py", *(["--strict"] if args.strict else [])))
    codes.append(bench("stream_latency.py", *(["--strict"] if args.strict else [])))
    codes.append(bench("bridges.py"))  # one bridge vs two (shared subscriptions)
    # 200 callers on `wait: true` for 60 s, and the readers meanwhile.
    codes.append(bench("waiters.py", *(["--strict"] if args.strict else [])))
    # Its own database (reachconsole_timeline_bench): loading 1,000,000 rows takes minutes.
    codes.append(bench("timeline.py", *(["--strict"] if args.strict else [])))
    # Its own database (reachconsole_overview_bench): the overview and the stats at a
    # thousand and at a million rows in their window.
    codes.append(bench("overview.py", *(["--strict"] if args.strict else [])))
    # Their own databases: the retention prune and the payload drop at a million rows.
    codes.append(bench("retention.py"))
    codes.append(bench("payloads.py"))
    # Their own databases: the partitioned history against one table, then 20 minutes at
    # 1,000 msg/s with a 5-minute retention (exits 1 when the tables outgrow their bound).
    codes.append(bench("partitions.py"))
    if any(code == 1 or code < 0 for code in codes):
        print("\nBENCH FAILED: a bench did not run to the end (see above)", file=sys.stderr)
        return 1
    return max(codes)


if __name__ == "__main__":
    raise SystemExit(main())
