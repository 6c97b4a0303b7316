"""Ways to write a batch of 500 message rows with psycopg 3, timed without MQTT.

The bridge once spent most of its CPU building one multi-row `INSERT … VALUES (…), (…) …`
statement (psycopg parses a query string with thousands of `%s` on every batch, because
statements that long are never cached). This script times the ways of sending the same
rows, so the cost of each is a number rather than a guess; `messages_insert_new` now uses
the last, json_to_recordset. It writes to its own table in the bench database. `--batch 10`
shows the cost at a steady 1,000 msg/s, where the bridge's batches are small.

    .venv/bin/python bench/insert_paths.py [--rows 20000] [--batch 500]
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from datetime import UTC, datetime

import common
import psycopg
from psycopg.types.json import Jsonb

TABLE = "bench_insert_paths"
COLUMNS = ("message_id", "task_id", "idempotency_key", "message_type", "direction", "status",
           "from_agent_id", "to_agent_id", "target_node_id", "origin_node_id",
           "reply_node_id", "conversation_id", "scene_group_id", "session_id", "topic",
           "headers", "payload", "error", "attempt", "in_reply_to", "created_at",
           "updated_at")
TYPES = ("text",) * 15 + ("jsonb", "jsonb", "text", "int4", "text", "timestamptz",
                          "timestamptz")
ON_CONFLICT = "ON CONFLICT (message_id) DO NOTHING RETURNING id, message_id"


def rows(n: int) -> list[tuple]:
    now = datetime.now(UTC)
    out = []
    for i in range(n):
        mid = str(uuid.uuid4())
        out.append((mid, f"task-{i}", mid, "TASK_REQUEST", "OBSERVED", "OBSERVED",
                    "bench.sender", "bench.worker", f"node-{i % 8}", "bench-pub", "bench-pub",
                    f"conv-{i % 100}", "", "", f"p/node/node-{i % 8}/inbox",
                    {"originNodeId": "bench-pub", "replyNodeId": "bench-pub"},
                    {"seq": i, "sentMs": 0.0, "text": "x" * 64}, "", 1, "", now, now))
    return out


def with_required(conn: psycopg.Connection, data: list[tuple]) -> list[tuple]:
    """Add the required columns the schema has gained since this was written (e.g. held)."""
    global COLUMNS, TYPES
    extra = common.unfilled_required(conn, TABLE, COLUMNS)
    kinds = {bool: "bool", int: "int8", str: "text"}
    COLUMNS = COLUMNS + tuple(extra)
    TYPES = TYPES + tuple(kinds[type(v)] for v in extra.values())
    values = tuple(extra.values())
    return [row + values for row in data]


def _jsonb(row: tuple) -> tuple:
    return (*row[:15], Jsonb(row[15]), Jsonb(row[16]), *row[17:])


def multi_values(cur: psycopg.Cursor, batch: list[tuple]) -> int:
    """One statement, len(batch) × 22 placeholders (the first insert path)."""
    one = "(" + ", ".join(["%s"] * len(COLUMNS)) + ")"
    cur.execute(f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) VALUES "
                f"{', '.join([one] * len(batch))} {ON_CONFLICT}",
                [v for row in batch for v in _jsonb(row)])
    return len(cur.fetchall())


def execute_many(cur: psycopg.Cursor, batch: list[tuple]) -> int:
    """One short statement, parsed once and pipelined per row."""
    cur.executemany(f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) VALUES "
                    f"({', '.join(['%s'] * len(COLUMNS))}) {ON_CONFLICT}",
                    [_jsonb(r) for r in batch], returning=True)
    count = 0
    while True:
        count += len(cur.fetchall())
        if not cur.nextset():
            return count


def unnest(cur: psycopg.Cursor, batch: list[tuple]) -> int:
    """22 array parameters: the statement text never changes, so psycopg caches it."""
    cols = list(zip(*batch, strict=True))
    arrays = [list(c) if t != "jsonb" else [json.dumps(v) for v in c]
              for c, t in zip(cols, TYPES, strict=True)]
    select = ", ".join(f"%s::{'text' if t == 'jsonb' else t}[]" for t in TYPES)
    casts = ", ".join(f"u.{c}::jsonb" if t == "jsonb" else f"u.{c}"
                      for c, t in zip(COLUMNS, TYPES, strict=True))
    cur.execute(f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) SELECT {casts} "
                f"FROM unnest({select}) AS u({', '.join(COLUMNS)}) {ON_CONFLICT}", arrays)
    return len(cur.fetchall())


def copy_then_insert(cur: psycopg.Cursor, batch: list[tuple]) -> int:
    """COPY into a temporary table, then one INSERT … SELECT … ON CONFLICT."""
    cur.execute(f"CREATE TEMP TABLE IF NOT EXISTS bench_stage ON COMMIT DELETE ROWS AS "
                f"SELECT {', '.join(COLUMNS)} FROM {TABLE} WITH NO DATA")
    with cur.copy(f"COPY bench_stage ({', '.join(COLUMNS)}) FROM STDIN") as copy:
        for row in batch:
            copy.write_row(_jsonb(row))
    cur.execute(f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) SELECT {', '.join(COLUMNS)} "
                f"FROM bench_stage {ON_CONFLICT}")
    return len(cur.fetchall())


def json_recordset(cur: psycopg.Cursor, batch: list[tuple]) -> int:
    """The batch as one JSON parameter, rows made by the database (messages_insert_new)."""
    typed = ", ".join(f"{c} {t}" for c, t in zip(COLUMNS, TYPES, strict=True))
    doc = [{c: (v.isoformat() if isinstance(v, datetime) else v)
            for c, v in zip(COLUMNS, row, strict=True) if v is not None} for row in batch]
    cur.execute(f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) SELECT {', '.join(COLUMNS)} "
                f"FROM json_to_recordset(%s::json) AS r({typed}) {ON_CONFLICT}",
                (json.dumps(doc),))
    return len(cur.fetchall())


WAYS = {"multi-row VALUES": multi_values, "executemany (pipeline)": execute_many,
        "unnest(arrays)": unnest, "COPY + INSERT SELECT": copy_then_insert,
        "json_to_recordset (today)": json_recordset}


def time_way(conn: psycopg.Connection, way, data: list[tuple], batch: int) -> dict:
    conn.execute(f"TRUNCATE {TABLE}")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    stored = 0
    for start in range(0, len(data), batch):
        with conn.transaction(), conn.cursor() as cur:
            stored += way(cur, data[start : start + batch])
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"rows": stored, "rows_per_s": stored / wall, "client_cpu_us_per_row":
            cpu / len(data) * 1e6, "wall_us_per_row": wall / len(data) * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=500)
    args = ap.parse_args()
    data = rows(args.rows)
    results = {}
    with psycopg.connect(host=common.HOST, port=common.PG_PORT, user="postgres",
                         dbname=common.BENCH_DB, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        conn.execute(f"CREATE TABLE {TABLE} (LIKE a2a_message INCLUDING ALL)")
        data = with_required(conn, data)
        for name, way in WAYS.items():
            results[name] = time_way(conn, way, data, args.batch)
        conn.execute(f"DROP TABLE {TABLE}")
    print(common.table(
        ["way", "rows", "rows/s", "client CPU us/row", "wall us/row"],
        [[k, f"{v['rows']:,}", common.fmt(v["rows_per_s"], 0),
          common.fmt(v["client_cpu_us_per_row"]), common.fmt(v["wall_us_per_row"])]
         for k, v in results.items()]))
    path = common.write_result("insert-paths", {"machine": common.machine(), **vars(args),
                                                "results": results})
    print(f"\nresults: {path.relative_to(common.ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
