"""The retention prune at a million rows: how fast `messages_prune` removes expired messages
and their transitions, and what a writer feels meanwhile.

`--rows` messages (bench/timeline.py's rows, spread over 7 days), each with two transitions,
all older than the retention; then `messages_prune` runs as beat runs it, one call after
another, until nothing is due, while a writer inserts a message every 10 ms on a connection
of its own. Prints the time of each kind of call, the rows a second, and the rate of traffic
the prune can keep up with when beat calls it once a minute.

Runs against its own database, `reachconsole_retention_bench`.

    .venv/bin/python bench/retention.py [--rows 1000000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import common
import psycopg
import timeline

DB = "reachconsole_retention_bench"
common.BENCH_DB = DB
common.DATABASE_URL = f"postgres://postgres@{common.HOST}:{common.PG_PORT}/{DB}"

TRANSITIONS = """
INSERT INTO a2a_transition (message_id, from_status, to_status, at, reason, actor, by)
SELECT id, s.f, s.t, created_at, '', 'bridge', ''
FROM a2a_message, (VALUES ('', 'SENT'), ('SENT', 'PUBLISHED')) AS s(f, t)
WHERE id BETWEEN %(first)s AND %(last)s
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    args = ap.parse_args(argv)
    common.check_postgres()
    # One table: this bench measures the batched delete and drop of a history that is
    # not partitioned (bench/partitions.py compares the two).
    os.environ["REACH_PARTITIONS"] = "0"
    common.django_setup(channel_prefix=common.run_tag("retention"))
    from django.conf import settings
    from django.utils import timezone

    from messages.sweeps import messages_prune

    common.migrate()
    print(f"seeding {args.rows:,} rows and {2 * args.rows:,} transitions", flush=True)
    timeline.seed(args.rows)
    seeded_at = timezone.now()
    with psycopg.connect(common.DATABASE_URL, autocommit=True) as conn:
        for first in range(1, args.rows + 1, 100_000):
            conn.execute(TRANSITIONS, {"first": first, "last": first + 99_999})
        conn.execute("VACUUM (ANALYZE) a2a_transition")
        sizes = {t: conn.execute(f"SELECT pg_table_size('{t}'), pg_indexes_size('{t}')"
                                 ).fetchone() for t in ("a2a_message", "a2a_transition")}
    per_message = {t: {"table": v[0] / args.rows, "indexes": v[1] / args.rows}
                   for t, v in sizes.items()}
    total = sum(v["table"] + v["indexes"] for v in per_message.values())
    print("bytes a message: " + "; ".join(
        f"{t} {v['table']:,.0f} + indexes {v['indexes']:,.0f}" for t, v in per_message.items())
        + f"; in all {total:,.0f}", flush=True)

    writer = common.Writer()
    writer.start()
    time.sleep(2)
    writer.window()
    # Everything seeded is past a retention of one day a day from now; the writer's rows,
    # written after the seeding, are not.
    settings.REACH_RETENTION_DAYS = 1
    now = seeded_at + timedelta(days=1)
    calls, deleted, took = common.calls_until_none(lambda: messages_prune(now=now))
    inserts, median, slowest = writer.window()
    writer.stop.set()
    writer.join()
    with psycopg.connect(common.DATABASE_URL, autocommit=True) as conn:
        left = conn.execute("SELECT (SELECT count(*) FROM a2a_message WHERE message_id LIKE 'm-%'),"
                            " (SELECT count(*) FROM a2a_transition)").fetchone()
    full = [s for n, s in calls[:-1]]
    per_call = statistics.median([n for n, _ in calls[:-1]]) if len(calls) > 1 else 0
    out = {"rows": args.rows, "bytes_per_message": per_message, "deleted": deleted,
           "seconds": took, "rows_per_s": deleted / took,
           "calls": len(calls), "rows_per_call": per_call,
           "call_s_median": statistics.median(full) if full else None,
           "call_s_max": max(full) if full else None,
           "left": {"messages": left[0], "transitions": left[1]},
           "writer": {"inserts": inserts, "median_ms": median, "slowest_ms": slowest},
           "schedule_s": settings.CELERY_BEAT_SCHEDULE["messages-prune"]["schedule"]}
    # A call runs until nothing is due or its budget is spent: at this rate, beat's calls
    # delete rate × budget each schedule period. (An older prune, run by this bench for a
    # before/after, stopped at 50 batches a call instead.)
    from messages import sweeps

    budget = getattr(sweeps, "PRUNE_BUDGET_S", None)
    if budget is None:
        sustained = 50 * sweeps.PRUNE_BATCH / out["schedule_s"]
    else:
        sustained = deleted / took * min(budget, out["schedule_s"]) / out["schedule_s"]
    out["sustained_msg_per_s"] = sustained
    print(f"messages_prune: {deleted:,} messages (and their transitions) in {took:.1f} s: "
          f"{deleted / took:,.0f} a second, {len(calls)} calls of {per_call:,.0f} rows, each "
          f"{common.fmt(out['call_s_median'], 2)} s median, "
          f"{common.fmt(out['call_s_max'], 2)} s at most; left: {left[0]} messages, "
          f"{left[1]} transitions", flush=True)
    print(f"the writer meanwhile: {inserts} inserts, median {median:.1f} ms, slowest "
          f"{slowest:.1f} ms", flush=True)
    print(f"called every {out['schedule_s']} s by beat ({budget or 'no'} s budget a call), "
          f"the prune keeps up with "
          f"{sustained:,.0f} messages a second", flush=True)
    out["machine"] = common.machine()
    path = common.write_result("retention", out)
    print(f"written to {path.relative_to(common.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
