"""Content is not history, at 1,000,000 rows: migrations 0010 and 0011 (the column, and the
index of kept payloads built CONCURRENTLY) and the payload drop, while a writer inserts.

1. The table at migration 0009 gets `--rows` messages over 7 days (PostgreSQL makes them:
   bench/timeline.py's rows, each with a payload of about 250 bytes).
2. Migrations 0010 and 0011 run while a writer inserts a row every 10 ms on a connection of
   its own: the migrations' time, and the writer's slowest insert meanwhile (a blocking
   build would hold it for the whole build).
3. `payloads_drop` (REACH_PAYLOAD_KEEP_HOURS=24) runs as beat runs it, one call after
   another, until nothing is due (the requests and responses older than a day that nothing
   can send again); each call's count and time, and the rows per second, the writer still
   inserting.
4. The table's size before and after, with a VACUUM between (what the space is worth once
   autovacuum has been by).

Runs against its own database, `reachconsole_payloads_bench`.

    .venv/bin/python bench/payloads.py [--rows 1000000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import common
import psycopg
import timeline

DB = "reachconsole_payloads_bench"
common.BENCH_DB = DB
common.DATABASE_URL = f"postgres://postgres@{common.HOST}:{common.PG_PORT}/{DB}"
SEED = timeline.SEED.replace("jsonb_build_object('n', i)",
                             "jsonb_build_object('n', i, 'question', repeat('x', 220))")
assert SEED != timeline.SEED


def _migrate(target: list[tuple[str, str]]) -> float:
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    started = time.monotonic()
    executor.migrate(target)
    return time.monotonic() - started


def _size() -> dict[str, int]:
    with psycopg.connect(common.DATABASE_URL, autocommit=True) as conn:
        row = conn.execute("SELECT pg_table_size('a2a_message'), pg_indexes_size('a2a_message'),"
                           " count(*) FILTER (WHERE payload IS NOT NULL) FROM a2a_message"
                           ).fetchone()
    return {"table": row[0], "indexes": row[1], "payloads": row[2]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    args = ap.parse_args(argv)
    common.check_postgres()
    # One table: this bench measures the batched delete and drop of a history that is
    # not partitioned (bench/partitions.py compares the two).
    os.environ["REACH_PARTITIONS"] = "0"
    common.django_setup(channel_prefix=common.run_tag("payloads"))
    from django.conf import settings
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    from messages.sweeps import payloads_drop

    leaves = MigrationExecutor(connection).loader.graph.leaf_nodes()
    _migrate(leaves)
    _migrate([("a2a", "0009_fewer_indexes")])
    timeline.SEED = SEED
    print(f"seeding {args.rows:,} rows at migration 0009", flush=True)
    timeline.seed(args.rows)
    out: dict = {"rows": args.rows, "before": _size()}

    writer = common.Writer()
    writer.start()
    time.sleep(2)
    writer.window()
    out["migration_s"] = _migrate(leaves)
    inserts, median, slowest = writer.window()
    out["migration_writer"] = {"inserts": inserts, "median_ms": median, "slowest_ms": slowest}
    out["after_migration"] = _size()
    print(f"migrations 0010 and 0011: {out['migration_s']:.1f} s; the writer meanwhile: {inserts} "
          f"inserts, median {median:.1f} ms, slowest {slowest:.1f} ms", flush=True)

    settings.REACH_PAYLOAD_KEEP_HOURS = 24
    calls, dropped, took = common.calls_until_none(payloads_drop)
    inserts, median, slowest = writer.window()
    out["drop"] = {"dropped": dropped, "seconds": took, "rows_per_s": dropped / took,
                   "calls": [{"dropped": n, "seconds": round(sec, 2)} for n, sec in calls],
                   "writer": {"inserts": inserts, "median_ms": median, "slowest_ms": slowest}}
    per_call = ", ".join(f"{n:,} in {sec:.1f} s" for n, sec in calls if n)
    print(f"payloads_drop: {dropped:,} payloads in {took:.1f} s ({dropped / took:,.0f} a "
          f"second); each call: {per_call}; the writer meanwhile: median {median:.1f} ms, "
          f"slowest {slowest:.1f} ms", flush=True)
    writer.stop.set()
    writer.join()
    out["after_drop"] = _size()
    with psycopg.connect(common.DATABASE_URL, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) a2a_message")
    out["after_vacuum"] = _size()
    rows = [[name, f"{s['table'] / 2**20:,.0f}", f"{s['indexes'] / 2**20:,.0f}",
             f"{s['payloads']:,}"] for name, s in
            (("at 0009", out["before"]), ("after 0010", out["after_migration"]),
             ("after the drop", out["after_drop"]), ("after VACUUM", out["after_vacuum"]))]
    print(common.table(["", "table MB", "indexes MB", "rows with a payload"], rows))
    out["machine"] = common.machine()
    path = common.write_result("payloads", out)
    print(f"written to {path.relative_to(common.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
