"""The lease sweep at scale: 100,000 lapsed leases cleared, with their history rows.

Goal: under 1 s on PostgreSQL for the whole sweep (roster.services.leases_expire, one
statement a batch). For comparison the same rows are swept by the portable path (the one
SQLite uses: claim, update, delete and insert the history from Python).

Runs against `reachconsole_bench` (bench/common.py), never a database the tests use.

    .venv/bin/python bench/leases.py [--agents 100000] [--draining 0.1] [--strict]
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

import common


def seed(agents: int, draining: float) -> None:
    """Agents whose leases all lapsed a minute ago (bulk insert: registering 100,000 one at a
    time would measure the seeding)."""
    from django.db import connection
    from django.utils import timezone

    from roster.models import Agent, ClusterNode, Namespace, RosterEvent

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE roster_agent, roster_rosterevent")
    ns = Namespace.objects.get_or_create(name="bench")[0]
    nodes = [ClusterNode.objects.get_or_create(node_id=f"bench-node-{i}")[0] for i in range(50)]
    lapsed = timezone.now() - timedelta(minutes=1)
    every = max(1, round(1 / draining)) if draining else 0
    rows = [
        Agent(namespace=ns, name=f"a{i}", agent_id=f"bench.a{i}", segment=f"a{i}",
              node=nodes[i % len(nodes)], lease_expires_at=lapsed,
              status=(Agent.Status.DRAINING if every and i % every == 0 else Agent.Status.ONLINE))
        for i in range(agents)
    ]
    Agent.objects.bulk_create(rows, batch_size=5000)
    assert not RosterEvent.objects.exists()


def sweep(portable: bool) -> dict:
    from django.db import transaction
    from django.utils import timezone

    from roster import services
    from roster.models import Agent, RosterEvent

    now = timezone.now()
    started = time.perf_counter()
    if portable:
        offline = removed = 0
        while True:  # the same loop leases_expire runs, over the portable batch
            with transaction.atomic():
                claimed, o, r = services._expire_batch(now=now, batch=20_000)
            offline, removed = offline + o, removed + r
            if claimed < 20_000:
                break
    else:
        counts = services.leases_expire(now=now)
        offline, removed = counts.offline, counts.removed
    seconds = time.perf_counter() - started
    left = Agent.objects.filter(status__in=["ONLINE", "DRAINING"]).count()
    return {"seconds": round(seconds, 3), "offline": offline, "removed": removed,
            "history_rows": RosterEvent.objects.count(), "left": left}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=100_000)
    ap.add_argument("--draining", type=float, default=0.1, help="share of DRAINING agents")
    ap.add_argument("--strict", action="store_true", help="exit 2 when the goal is not met")
    args = ap.parse_args(argv)
    common.django_setup(channel_prefix=common.run_tag("leases"))
    from django.conf import settings

    # Leases lapse only over time the console heard the bus; this bench judges by the clock.
    settings.REACH_JUDGE_BY_CLOCK = True
    results = {}
    for name, portable in (("one statement a batch (PostgreSQL)", False),
                           ("portable (claim, update, delete, insert)", True)):
        seed(args.agents, args.draining)
        results[name] = sweep(portable)
        assert results[name]["left"] == 0, f"{name} left rows behind"
        assert results[name]["history_rows"] == args.agents, f"{name}: history rows missing"
    print(common.table(
        ["path", "seconds", "offline", "removed", "history rows"],
        [[name, f"{r['seconds']:.3f}", str(r["offline"]), str(r["removed"]),
          str(r["history_rows"])] for name, r in results.items()]))
    fast = results["one statement a batch (PostgreSQL)"]["seconds"]
    met = fast < 1.0
    print(f"\ngoal: {args.agents:,} lapsed leases in under 1 s: {'met' if met else 'NOT MET'} "
          f"({fast:.3f} s)")
    path = common.write_result("leases", {"agents": args.agents, "draining": args.draining,
                                          "results": results, "goal_met": met,
                                          "machine": common.machine()})
    print(f"written to {path.relative_to(common.ROOT)}")
    return 2 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
