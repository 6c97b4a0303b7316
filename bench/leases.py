"""The lease sweep at scale: 100,000 lapsed leases cleared, with their history rows.

Goal: under 1 s on PostgreSQL for the whole sweep (roster.services.leases_expire, one
statement a batch, shared out between REACH_LEASE_SWEEP_WORKERS connections). For comparison
the same rows are swept by the portable path (the one SQLite uses: claim, update, delete and
insert the history from Python, on one connection).

Runs against `reachconsole_bench` (bench/common.py), never a database the tests use.

    .venv/bin/python bench/leases.py [--agents 100000] [--draining 0.1] [--strict] [--repeat 3]
                                     [--workers 2] [--no-portable]

Besides the seconds it records the WAL written while the sweep ran, the share of the
sweep's updates of roster_agent that were HOT (no index entry), and the indexes of
roster_agent. The WAL is the work done (row versions, index entries) and does not swing with
CPU load the way the seconds do; but it is the whole server's, so it counts only this sweep
when nothing else writes to that PostgreSQL.
"""

from __future__ import annotations

import argparse
import sys
import time

import common


def seed(agents: int, draining: float) -> None:
    """Agents whose leases all lapsed a minute ago, one in 1/draining DRAINING, over 50 nodes.
    Inserted by one INSERT ... SELECT (registering 100,000 one at a time would measure the
    seeding), then vacuumed and analysed as a table that has lived a while would be."""
    from django.db import connection

    from roster.models import ClusterNode, Namespace, RosterEvent

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE roster_leasedeadline, roster_agent, roster_rosterevent")
    ns = Namespace.objects.get_or_create(name="bench")[0]
    for i in range(50):
        ClusterNode.objects.get_or_create(node_id=f"bench-node-{i}")
    every = max(1, round(1 / draining)) if draining else 0
    with connection.cursor() as cursor:
        cursor.execute("""
            INSERT INTO roster_agent (name, agent_id, segment, version, endpoint, owner,
                capabilities, groups, metadata, max_inflight, status, lease_expires_at,
                last_heartbeat_at, inflight, queue_depth, registered_at, updated_at,
                node_id, namespace_id)
            SELECT 'a' || i, 'bench.a' || i, 'a' || i, '', '', '', '[]', '[]', '{}', 8,
                   CASE WHEN %(every)s > 0 AND i %% %(every)s = 0 THEN 'DRAINING'
                        ELSE 'ONLINE' END,
                   now() - interval '1 minute', now() - interval '2 minutes', 0, 0,
                   now() - interval '1 hour', now(), n.id, %(ns)s
            FROM generate_series(0, %(agents)s - 1) i
            JOIN roster_clusternode n ON n.node_id = 'bench-node-' || (i %% 50)
        """, {"every": every, "ns": ns.pk, "agents": agents})
        # As registrations would leave them: each live agent with its sweep deadline.
        cursor.execute("INSERT INTO roster_leasedeadline (agent_id, expires_at) "
                       "SELECT id, lease_expires_at FROM roster_agent")
        cursor.execute("VACUUM ANALYZE roster_agent")
        cursor.execute("VACUUM ANALYZE roster_leasedeadline")
        cursor.execute("VACUUM ANALYZE roster_rosterevent")
    assert not RosterEvent.objects.exists()


def sweep(portable: bool) -> dict:
    from django.db import transaction
    from django.utils import timezone

    from roster import services
    from roster.models import Agent, RosterEvent

    now = timezone.now()
    updates_before = _agent_updates()
    wal_before = _wal_lsn()
    started = time.perf_counter()
    if portable:
        offline = removed = 0
        while True:  # the same loop leases_expire runs, over the portable batch
            with transaction.atomic():
                claimed, seen, o, r = services._expire_batch(now=now, batch=20_000)
            offline, removed = offline + o, removed + r
            if claimed < 20_000 or not seen:
                break
    else:
        counts = services.leases_expire(now=now)
        offline, removed = counts.offline, counts.removed
    seconds = time.perf_counter() - started
    wal_mb = _wal_mb_since(wal_before)
    # The sweep's other connections go back to the pool open, and report their counts
    # once idle: within PostgreSQL's 10 s idle flush.
    for _ in range(250):
        after = _agent_updates()
        updated, hot = after[0] - updates_before[0], after[1] - updates_before[1]
        if updated >= offline:
            break
        time.sleep(0.05)
    left = Agent.objects.filter(status__in=["ONLINE", "DRAINING"]).count()
    return {"seconds": round(seconds, 3), "wal_mb": wal_mb, "offline": offline,
            "hot_share": round(hot / updated, 3) if updated else None,
            "removed": removed, "history_rows": RosterEvent.objects.count(), "left": left}


def _agent_updates() -> tuple[int, int]:
    """Updates of roster_agent so far, and how many of them were HOT (no index entry). This
    backend's counts are flushed first, so the sweep it just ran is in them."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                       "WHERE relname = 'roster_agent'")
        return cursor.fetchone()


def _wal_lsn() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_wal_lsn()")
        return cursor.fetchone()[0]


def _wal_mb_since(lsn: str) -> float:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", [lsn])
        return round(float(cursor.fetchone()[0]) / 1e6, 1)


def indexes(table: str) -> list[str]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE tablename = %s ORDER BY indexname",
                       [table])
        return [row[0].split(" USING ", 1)[1] for row in cursor.fetchall()]


def statistics_median(runs: list[dict]) -> dict:
    """The run with the median seconds (its WAL and counts with it)."""
    ordered = sorted(runs, key=lambda run: run["seconds"])
    return dict(ordered[(len(ordered) - 1) // 2])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=100_000)
    ap.add_argument("--draining", type=float, default=0.1, help="share of DRAINING agents")
    ap.add_argument("--strict", action="store_true", help="exit 2 when the goal is not met")
    ap.add_argument("--repeat", type=int, default=1, help="sweeps per path (the median counts)")
    ap.add_argument("--no-portable", action="store_true", help="skip the portable path")
    ap.add_argument("--workers", type=int, default=None,
                    help="connections sharing a backlog (REACH_LEASE_SWEEP_WORKERS)")
    args = ap.parse_args(argv)
    common.django_setup(channel_prefix=common.run_tag("leases"))
    from django.conf import settings

    # Leases lapse only over time the console heard the bus; this bench judges by the clock.
    settings.REACH_JUDGE_BY_CLOCK = True
    if args.workers:
        settings.REACH_LEASE_SWEEP_WORKERS = args.workers
    fast_path, portable_path = ("one statement a batch (PostgreSQL)",
                                "portable (claim, update, delete, insert)")
    paths = [(fast_path, False)] + ([] if args.no_portable else [(portable_path, True)])
    runs: dict[str, list[dict]] = {name: [] for name, _ in paths}
    for _ in range(args.repeat):
        for name, portable in paths:  # alternating, so a burst of other load hits both
            seed(args.agents, args.draining)
            run = sweep(portable)
            assert run["left"] == 0, f"{name} left rows behind"
            assert run["history_rows"] == args.agents, f"{name}: history rows missing"
            runs[name].append(run)
    results = {name: {**statistics_median(rs), "runs": rs} for name, rs in runs.items()}
    print(common.table(
        ["path", "seconds (median)", "range", "server WAL MB", "HOT updates", "offline",
         "removed", "history rows"],
        [[name, f"{r['seconds']:.3f}",
          f"{min(x['seconds'] for x in r['runs']):.3f}-{max(x['seconds'] for x in r['runs']):.3f}",
          f"{r['wal_mb']:.0f}",
          "-" if r["hot_share"] is None else f"{100 * r['hot_share']:.0f} %",
          str(r["offline"]), str(r["removed"]), str(r["history_rows"])]
         for name, r in results.items()]))
    agent_indexes = indexes("roster_agent")
    print(f"\nroster_agent indexes ({len(agent_indexes)}):\n  " + "\n  ".join(agent_indexes))
    fast = results[fast_path]["seconds"]
    met = fast < 1.0
    print(f"\ngoal: {args.agents:,} lapsed leases in under 1 s: {'met' if met else 'NOT MET'} "
          f"({fast:.3f} s, median of {args.repeat})")
    path = common.write_result("leases", {"agents": args.agents, "draining": args.draining,
                                          "workers": settings.REACH_LEASE_SWEEP_WORKERS,
                                          "results": results, "goal_met": met,
                                          "roster_agent_indexes": agent_indexes,
                                          "rosterevent_indexes": indexes("roster_rosterevent"),
                                          "machine": common.machine()})
    print(f"written to {path.relative_to(common.ROOT)}")
    return 2 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
