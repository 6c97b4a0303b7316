"""The partitioned history against one table, same run: drop against delete at a million
rows, bytes a message, the insert and the timeline, and a history bounded under load.

Each mode runs in a child process on a database of its own, created fresh:
`reachconsole_flat_bench` migrated with REACH_PARTITIONS=off (one table, the batched
delete) and `reachconsole_part_bench` (a partition a day). In each:

1. `--rows` messages over the 7 days before now (bench/timeline.py's rows; on the
   partitioned database each in the partition of its day), two transitions each;
   bytes a message (table + indexes + transitions, and the key table where there is one);
2. the insert path (`messages_insert_new`): batches of 500 and of 5, rows a second;
3. the timeline's first page and filters (bench/timeline.py's requests): `--rounds`
   rounds, alternating between the two databases, each figure the median over the rounds
   of the median of 20 requests, with the database's share timed around each query;
4. removing all of it once past a retention of one day: `messages_prune` until nothing
   is due against `partitions_drop` and the key prune, seconds (each drop's own from
   `partitions_drop`).

Then the move of an existing history: `--rows` messages on one table, partitioned in
place by `manage.py history_partition` (the migration's work) while a writer inserts every
10 ms: how long it takes, and how long the writer waits.

Then `--bounded-minutes` (20) on a third database, partitioned by 20 s spans with a
retention of 0.0035 days (about 5 minutes): a writer stores 1,000 messages a second, each
with a transition, through `messages_insert_new`, while `partitions_maintain` runs as beat
runs it (every half span); the rows of both tables are counted every 10 s against
retention × rate × 1.2, and every drop is timed.

    .venv/bin/python bench/partitions.py [--rows 1000000] [--bounded-minutes 20] [--rounds 3]
        [--modes flat,part,move,bounded]
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
import uuid
from datetime import timedelta

import common
import timeline  # sets common's database: _setup sets it again

DBS = {"flat": "reachconsole_flat_bench", "part": "reachconsole_part_bench",
       "bounded": "reachconsole_bounded_bench"}
RATE = 1000
BOUNDED_RETENTION_DAYS = 0.0035
BOUNDED_SPAN = "20s"
DISK = 10 ** 12


def _fresh_database(name: str) -> None:
    import psycopg

    with psycopg.connect(host=common.HOST, port=common.PG_PORT, user="postgres",
                         dbname="postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def _setup(mode: str) -> None:
    db = DBS[mode]
    common.BENCH_DB = db
    common.DATABASE_URL = f"postgres://postgres@{common.HOST}:{common.PG_PORT}/{db}"
    os.environ["REACH_PARTITIONS"] = "0" if mode == "flat" else "1"
    if mode == "bounded":
        os.environ["REACH_PARTITION_SPAN"] = BOUNDED_SPAN
        os.environ["REACH_PARTITIONS_AHEAD"] = "6"
    _fresh_database(db)
    common.migrate()
    common.django_setup(channel_prefix=common.run_tag(f"part{mode}"))


def _history_from(days_ago: int) -> None:
    """Partitions from `days_ago` days back on, as a week of running would have left: the
    fresh database's first partition ends at today's start, so it is made again ending
    then (the tables are empty: instant)."""
    from django.db import connection, transaction
    from django.utils import timezone

    from messages import partitions

    with transaction.atomic(), connection.cursor() as cursor:
        partitions.history_unpartition(cursor)
        partitions.partitioned_forget()
        partitions.history_partition(cursor, now=timezone.now() - timedelta(days=days_ago))
    partitions.partitioned_forget()
    partitions.partitions_ensure(now=timezone.now())


def _seed(rows: int, partitioned: bool) -> dict:
    import psycopg

    sql = timeline.SEED
    if partitioned:  # each row's id from its time, as the insert path draws it
        at = "%(end)s::timestamptz - (%(n)s::bigint - i) * %(step)s::interval"
        sql = (sql.replace("INSERT INTO a2a_message (message_id,",
                           "INSERT INTO a2a_message (id, message_id,")
               .replace("SELECT 'm-' || i,", f"SELECT a2a_message_pk({at}), 'm-' || i,"))
    timeline.SEED = sql
    started = time.monotonic()
    timeline.seed(rows)
    with psycopg.connect(common.DATABASE_URL, autocommit=True) as conn:
        if partitioned:
            conn.execute("INSERT INTO a2a_message_key (message_id, message_pk) "
                         "SELECT message_id, id FROM a2a_message")
        # The task entries the ledger keeps beside the requests (messages/ledger.py): the
        # timeline's task filter reads where a task began from them.
        conn.execute("""
            INSERT INTO a2a_task (direction, task_id, member, status, to_agent_id,
                from_agent_id, target_node_id, conversation_id, attempts, created_at,
                updated_at, error, answered_by, last_message_id)
            SELECT direction, task_id, '', status, to_agent_id, from_agent_id, target_node_id,
                conversation_id, 1, created_at, updated_at, error, '', message_id
            FROM a2a_message WHERE message_type = 'TASK_REQUEST'""")
        conn.execute("""
            INSERT INTO a2a_transition (message_id, from_status, to_status, at, reason, actor, by)
            SELECT id, s.f, s.t, created_at, '', 'bridge', ''
            FROM a2a_message, (VALUES ('', 'SENT'), ('SENT', 'PUBLISHED')) AS s(f, t)""")
        conn.execute("VACUUM (ANALYZE) a2a_message, a2a_transition, a2a_message_key, a2a_task")
        size = {}
        for table in ("a2a_message", "a2a_transition", "a2a_message_key"):
            # A partitioned table's own size is zero: its partitions hold the bytes.
            got = conn.execute(
                "SELECT coalesce(sum(pg_table_size(c.oid)), 0), "
                "coalesce(sum(pg_indexes_size(c.oid)), 0) FROM pg_class c "
                "WHERE c.oid = to_regclass(%s) OR c.oid IN "
                "(SELECT inhrelid FROM pg_inherits WHERE inhparent = to_regclass(%s))",
                [table, table]).fetchone()
            size[table] = {"table": int(got[0]) / rows, "indexes": int(got[1]) / rows}
        parts = conn.execute("SELECT count(*) FROM pg_inherits "
                             "WHERE inhparent = to_regclass('a2a_message')").fetchone()[0]
    total = sum(v["table"] + v["indexes"] for v in size.values())
    return {"seed_s": time.monotonic() - started, "bytes": size, "bytes_total": total,
            "partitions": parts,
            "days_per_tb_at_1000": DISK / (total * RATE * 86400)}


def _received(n: int, now):
    from messages.models import Direction, Status
    from messages.rows import ReceivedRow

    tag = uuid.uuid4().hex[:12]
    return [ReceivedRow(
        message_id=f"i-{tag}-{i}", task_id=f"t-{tag}-{i}", idempotency_key="",
        message_type="TASK_REQUEST", direction=Direction.OBSERVED, status=Status.OBSERVED,
        from_agent_id="ns1.agent1", to_agent_id="ns2.agent2", target_node_id="node-2",
        origin_node_id="node-1", reply_node_id="node-1", conversation_id="", scene_group_id="",
        session_id="", topic="p/node/node-2/inbox", headers={"originNodeId": "node-1"},
        payload=None, attempt=1, in_reply_to="", created_at=now, updated_at=now)
        for i in range(n)]


def _insert_rate(batch: int, total: int) -> float:
    from django.db import transaction
    from django.utils import timezone

    from messages.state import messages_insert_new

    batches = [_received(batch, timezone.now()) for _ in range(total // batch)]
    started = time.perf_counter()
    for rows in batches:
        with transaction.atomic():
            messages_insert_new(rows)
    return total / (time.perf_counter() - started)


def _timeline(rows: int) -> dict:
    client = common.signed_in_client("bench-partitions", "resend_message")
    return timeline.measure(client, rows, repeat=20)


def _remove(partitioned: bool) -> dict:
    from django.conf import settings
    from django.utils import timezone

    settings.REACH_RETENTION_DAYS = 1
    later = timezone.now() + timedelta(days=9)
    if not partitioned:
        from messages.sweeps import messages_prune

        calls, deleted, took = common.calls_until_none(lambda: messages_prune(now=later))
        return {"how": "messages_prune", "messages": deleted, "seconds": took,
                "calls": len(calls)}
    from messages import partitions
    from messages.models import Message

    before = Message.objects.count()
    started = time.monotonic()
    dropped = partitions.partitions_drop(now=later)
    drop_s = time.monotonic() - started
    started = time.monotonic()
    keys = partitions.message_keys_prune(stop_at=float("inf"))
    keys_s = time.monotonic() - started
    return {"how": "partitions_drop", "messages": before - Message.objects.count(),
            "seconds": drop_s, "partitions": len(dropped),
            "drop_s_max": max((d.seconds for d in dropped), default=None), "keys": keys,
            "keys_s": keys_s}


def _attach(mode: str) -> None:
    """Django against the database an earlier stage of this run seeded (no fresh one)."""
    db = DBS[mode]
    common.BENCH_DB = db
    common.DATABASE_URL = f"postgres://postgres@{common.HOST}:{common.PG_PORT}/{db}"
    os.environ["REACH_PARTITIONS"] = "0" if mode == "flat" else "1"
    common.django_setup(channel_prefix=common.run_tag(f"part{mode}"))


def child(mode: str, rows: int, stage: str) -> dict:
    """One stage of one side: "seed" (a fresh database, its rows, bytes, the insert),
    "timeline" (one round of the timeline's requests) or "remove" (the expired history
    gone). The parent alternates the timeline rounds between the sides: on a shared
    2-core box a single round of each drifts by more than the difference it measures."""
    partitioned = mode == "part"
    if stage == "timeline":
        _attach(mode)
        return {"timeline_ms": _timeline(rows)}
    if stage == "remove":
        _attach(mode)
        out = _remove(partitioned)
        print(f"[{mode}] removed {out['messages']:,} in {out['seconds']:.2f} s",
              file=sys.stderr, flush=True)
        return {"remove": out}
    _setup(mode)
    if partitioned:
        _history_from(8)
    out = {"mode": mode, "rows": rows, "seed": _seed(rows, partitioned)}
    print(f"[{mode}] seeded in {out['seed']['seed_s']:.0f} s, "
          f"{out['seed']['bytes_total']:,.0f} bytes a message", file=sys.stderr, flush=True)
    out["insert_rows_per_s"] = {f"batch {b}": statistics.median(
        _insert_rate(b, 10_000 if b > 50 else 2_000) for _ in range(3)) for b in (500, 5)}
    return out


def _run_child(*args: str) -> dict | None:
    done = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                          text=True, check=False, cwd=common.ROOT)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def sides(rows: int, modes: list[str], rounds: int) -> dict[str, dict | None]:
    """Seed each side, then the timeline's rounds alternating between them (each figure
    the median of the rounds' medians), then remove each side's history."""
    out: dict[str, dict | None] = {m: _run_child(m, "--rows", str(rows), "--stage", "seed")
                                   for m in modes}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(rounds):
        for m in modes:
            if out[m] is not None:
                got = _run_child(m, "--rows", str(rows), "--stage", "timeline")
                if got is None:
                    out[m] = None
                else:
                    runs[m].append(got["timeline_ms"])
    for m in modes:
        if out[m] is None:
            continue
        out[m]["timeline_ms"] = {k: statistics.median(r[k] for r in runs[m])
                                 for k in runs[m][0]}
        out[m]["timeline_rounds"] = runs[m]
        got = _run_child(m, "--rows", str(rows), "--stage", "remove")
        out[m] = {**out[m], **got} if got else None
    return out


def move(rows: int) -> dict:
    """The command that partitions a history of `rows` messages in place (what the migration
    does), timed, with a writer inserting every 10 ms meanwhile: how long writes wait."""
    _setup("flat")
    from django.core.management import call_command

    from messages import partitions

    out = {"rows": rows, "seed": _seed(rows, partitioned=False)}
    writer = common.Writer()
    writer.start()
    time.sleep(2)
    writer.window()
    started = time.monotonic()
    call_command("history_partition")
    out["seconds"] = time.monotonic() - started
    time.sleep(2)
    inserts, median, slowest = writer.window()
    writer.stop.set()
    writer.join()
    out["writer"] = {"inserts": inserts, "median_ms": median, "slowest_ms": slowest}
    out["partitioned"] = partitions.history_partitioned()
    print(f"[move] {rows:,} messages partitioned in place in {out['seconds']:.1f} s; "
          f"the writer's slowest insert {slowest:.0f} ms", file=sys.stderr, flush=True)
    return out


def bounded(minutes: float) -> dict:
    _setup("bounded")
    from django.conf import settings
    from django.db import connection, transaction
    from django.utils import timezone

    from messages import partitions
    from messages.models import Transition
    from messages.state import messages_insert_new

    assert partitions.history_partitioned(), "the bounded run needs the partitioned history"
    settings.REACH_RETENTION_DAYS = BOUNDED_RETENTION_DAYS
    span = settings.REACH_PARTITION_SPAN_S
    limit = BOUNDED_RETENTION_DAYS * 86400 * RATE * 1.2
    stop = threading.Event()
    drops: list[float] = []
    errors: list[str] = []

    def maintain() -> None:
        try:
            while not stop.wait(span / 2):
                started = time.monotonic()
                result = partitions.partitions_maintain(now=timezone.now())
                if result.get("dropped"):
                    drops.append((time.monotonic() - started) / result["dropped"])
        except Exception as exc:  # noqa: BLE001 - reported, and the run fails
            errors.append(repr(exc))
        finally:
            connection.close()

    worker = threading.Thread(target=maintain, daemon=True)
    worker.start()
    samples, written = [], 0
    started = time.monotonic()
    next_sample = started
    tick = 0.1  # 100 messages every 100 ms
    while time.monotonic() - started < minutes * 60:
        due = started + tick * (written // int(RATE * tick))
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        now = timezone.now()
        with transaction.atomic():
            fresh = messages_insert_new(_received(int(RATE * tick), now))
            Transition.objects.bulk_create(
                [Transition(message_id=r.pk, from_status="", to_status="OBSERVED", at=now,
                            actor="bridge") for r in fresh])
        written += len(fresh)
        if time.monotonic() >= next_sample:
            next_sample += 10
            with connection.cursor() as cursor:
                cursor.execute("SELECT (SELECT count(*) FROM a2a_message), "
                               "(SELECT count(*) FROM a2a_transition), "
                               "(SELECT count(*) FROM a2a_message_key)")
                counts = cursor.fetchone()
            samples.append({"t": round(time.monotonic() - started), "messages": counts[0],
                            "transitions": counts[1], "keys": counts[2]})
    stop.set()
    worker.join(timeout=60)
    took = time.monotonic() - started
    return {"minutes": minutes, "rate_target": RATE, "rate": written / took, "written": written,
            "span_s": span, "retention_s": BOUNDED_RETENTION_DAYS * 86400, "limit": limit,
            "max_messages": max(s["messages"] for s in samples),
            "max_transitions": max(s["transitions"] for s in samples),
            "max_keys": max(s["keys"] for s in samples),
            "drops": len(drops), "drop_s_max": max(drops) if drops else None,
            "drop_s_median": statistics.median(drops) if drops else None,
            "errors": errors, "samples": samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--bounded-minutes", type=float, default=20)
    ap.add_argument("--child", choices=["flat", "part", "move", "bounded"])
    ap.add_argument("--stage", choices=["seed", "timeline", "remove"], default="seed")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timeline rounds, alternating between the two sides")
    ap.add_argument("--modes", default="flat,part,move,bounded",
                    help="which parts to run; the report takes the others from their latest "
                         "result files (bench/results/partitions-<mode>-*.json)")
    args = ap.parse_args(argv)
    if args.child == "bounded":
        print(json.dumps(bounded(args.bounded_minutes)))
        return 0
    if args.child == "move":
        print(json.dumps(move(args.rows)))
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.rows, args.stage)))
        return 0
    out: dict = {"rows": args.rows}
    modes = args.modes.split(",")
    failed = False
    both = [m for m in ("flat", "part") if m in modes]
    for mode, got in sides(args.rows, both, args.rounds).items():
        if got is None:
            print(f"{mode}: failed")
            failed = True
            continue
        out[mode] = got
        common.write_result(f"partitions-{mode}", got)
    for mode in ("flat", "part", "move", "bounded"):
        if mode in both:
            continue
        if mode not in modes or (mode == "bounded" and args.bounded_minutes <= 0):
            found = sorted(common.RESULTS.glob(f"partitions-{mode}-*.json"))
            if found:
                out[mode] = json.loads(found[-1].read_text())
                print(f"{mode}: from {found[-1].relative_to(common.ROOT)}")
            continue
        done = subprocess.run([sys.executable, __file__, "--child", mode, "--rows",
                               str(args.rows), "--bounded-minutes", str(args.bounded_minutes)],
                              capture_output=True, text=True, check=False, cwd=common.ROOT)
        if done.returncode:
            sys.stderr.write(done.stderr[-4000:])
            print(f"{mode}: failed")
            failed = True
            continue
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        # Each part kept as it ends: a later part that fails loses nothing before it.
        common.write_result(f"partitions-{mode}", out[mode])
    if not {"flat", "part"} <= out.keys():
        print("the report needs both sides (flat and part)")
        return 1
    _report(out)
    out["machine"] = common.machine()
    out["git"] = common.git_state()
    path = common.write_result("partitions", out)
    print(f"written to {path.relative_to(common.ROOT)}")
    for name in DBS.values():
        import psycopg

        with psycopg.connect(host=common.HOST, port=common.PG_PORT, user="postgres",
                             dbname="postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    bounded_out = out.get("bounded")
    ok = bounded_out is None or (bounded_out["max_messages"] <= bounded_out["limit"]
                                 and bounded_out["max_transitions"] <= bounded_out["limit"]
                                 and not bounded_out["errors"])
    return 0 if ok and not failed else 1


def _report(out: dict) -> None:
    flat, part = out["flat"], out["part"]
    rows = [["bytes a message (all tables)", f"{flat['seed']['bytes_total']:,.0f}",
             f"{part['seed']['bytes_total']:,.0f}", ""],
            ["days of history on 1 TB at 1,000 msg/s",
             f"{flat['seed']['days_per_tb_at_1000']:.1f}",
             f"{part['seed']['days_per_tb_at_1000']:.1f}", ""]]
    for name, value in flat["insert_rows_per_s"].items():
        other = part["insert_rows_per_s"][name]
        rows.append([f"insert rows/s, {name}", f"{value:,.0f}", f"{other:,.0f}",
                     f"{other / value:.2f}"])
    for name, value in flat["timeline_ms"].items():
        if name.endswith("(database)"):
            continue
        other = part["timeline_ms"][name]
        db, other_db = flat["timeline_ms"][f"{name} (database)"], part["timeline_ms"][
            f"{name} (database)"]
        rows.append([f"timeline {name}: ms (of it the database)", f"{value:.1f} ({db:.2f})",
                     f"{other:.1f} ({other_db:.2f})", f"{other / value:.2f}"])
    rows.append([f"remove {flat['remove']['messages']:,} expired messages, s",
                 f"{flat['remove']['seconds']:.2f}", f"{part['remove']['seconds']:.2f}", ""])
    print(common.table(["", "one table", "partitioned", "ratio"], rows))
    print(f"partitioned: {part['remove']['partitions']} partitions dropped, the slowest in "
          f"{common.fmt(part['remove']['drop_s_max'], 3)} s; then {part['remove']['keys']:,} "
          f"message keys pruned in {part['remove']['keys_s']:.1f} s")
    m = out.get("move")
    if m:
        print(f"moving a history of {m['rows']:,} messages into partitions (manage.py "
              f"history_partition, the migration's work): {m['seconds']:.1f} s, a writer's "
              f"slowest insert meanwhile {m['writer']['slowest_ms']:,.0f} ms")
    b = out.get("bounded")
    if b:
        print(f"bounded: {b['minutes']:g} min at {b['rate']:,.0f} msg/s, retention "
              f"{b['retention_s']:.0f} s, spans of {b['span_s']} s: at most "
              f"{b['max_messages']:,} messages and {b['max_transitions']:,} transitions "
              f"(limit {b['limit']:,.0f}), {b['max_keys']:,} keys; {b['drops']} drops, "
              f"median {common.fmt(b['drop_s_median'], 3)} s, slowest "
              f"{common.fmt(b['drop_s_max'], 3)} s; errors: {b['errors'] or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
