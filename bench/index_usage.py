"""Which indexes of the history tables a workload reads: `pg_stat_user_indexes.idx_scan` of
`a2a_message`, `a2a_transition` and `a2a_task`, in each database named, summed.

Run it after the test suite (with `--reuse-db`, so its database is still there) and after
the benches, each in its own database; an index no workload scanned is a cost on every row
stored for nothing. `--reset` zeroes the counters of the named databases first.

    .venv/bin/python bench/index_usage.py --database test_reachidx \\
        --database reachconsole_bench --database reachconsole_timeline_bench [--reset]
"""

from __future__ import annotations

import argparse
import sys

import common
import psycopg

TABLES = ("a2a_message", "a2a_transition", "a2a_task")
QUERY = """
SELECT s.relname, s.indexrelname, s.idx_scan, pg_relation_size(s.indexrelid)
FROM pg_stat_user_indexes s WHERE s.relname = ANY(%s)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--database", action="append", required=True)
    ap.add_argument("--reset", action="store_true")
    args = ap.parse_args(argv)
    scans: dict[tuple[str, str], dict[str, int]] = {}
    for name in args.database:
        url = f"postgres://postgres@{common.HOST}:{common.PG_PORT}/{name}"
        with psycopg.connect(url, autocommit=True) as conn:
            if args.reset:
                conn.execute("SELECT pg_stat_reset()")
                print(f"{name}: counters reset")
                continue
            for table, index, count, _size in conn.execute(QUERY, [list(TABLES)]).fetchall():
                scans.setdefault((table, index), {})[name] = count
    if args.reset:
        return 0
    headers = ["table", "index", *args.database, "in all"]
    rows = []
    for (table, index), by_db in sorted(scans.items()):
        counts = [by_db.get(db) for db in args.database]
        total = sum(c or 0 for c in counts)
        rows.append([table, index, *["-" if c is None else f"{c:,}" for c in counts],
                     f"{total:,}" if total else "**0**"])
    print(common.table(headers, rows))
    unused = [f"{t}.{i}" for (t, i), by_db in scans.items() if not any(by_db.values())]
    print(f"\nnever scanned: {', '.join(sorted(unused)) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
