"""resolve() latency with 10,000 agents and 2,000 aliases, in process.

Goal: p99 under 2 ms. Uses DATABASE_URL when set (else a SQLite file in a temp dir), on a
database of its own: run it against `reachconsole_bench`, never a database tests use.

    .venv/bin/python bench/resolve.py [--agents 10000] [--aliases 2000] [--queries 5000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "reachconsole.settings")
    if not os.environ.get("DATABASE_URL"):
        os.environ["REACH_RUN_DIR"] = tempfile.mkdtemp(prefix="reach-bench-")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)


def seed(agents: int, aliases: int, rng: random.Random) -> tuple[list[str], list[str], list[str]]:
    """The roster as it would be after many registrations (bulk insert: seeding 10,000 rows
    one registration at a time would measure the seeding, not the directory)."""
    from django.utils import timezone

    from directory.models import Alias
    from roster.models import Agent, ClusterNode, Namespace, RosterEvent

    Alias.objects.all().delete()
    Agent.objects.all().delete()
    RosterEvent.objects.all().delete()
    namespaces = [Namespace.objects.get_or_create(name=f"ns{i}")[0] for i in range(20)]
    nodes = [ClusterNode.objects.get_or_create(node_id=f"node-{i}")[0] for i in range(50)]
    now = timezone.now()
    rows, segments = [], [f"skill{i}" for i in range(agents // 4)]
    for i in range(agents):
        ns = namespaces[i % len(namespaces)]
        segment = segments[i % len(segments)]
        name = f"team{i}.{segment}"
        rows.append(Agent(
            namespace=ns, name=name, agent_id=f"{ns.name}.{name}", segment=segment,
            node=nodes[i % len(nodes)], capabilities=[segment], groups=[f"#g{i % 30}"],
            lease_expires_at=now + timedelta(hours=1), last_heartbeat_at=now + timedelta(hours=1),
            inflight=rng.randint(0, 8), max_inflight=8,
        ))
    Agent.objects.bulk_create(rows, batch_size=1000)
    ids = [r.agent_id for r in rows]
    alias_rows = [Alias(alias=f"别名{i}", agent_id=rng.choice(ids),
                        namespace=namespaces[i % len(namespaces)]) for i in range(aliases)]
    Alias.objects.bulk_create(alias_rows, batch_size=1000)
    # Seeded behind the roster's services: tell readers the roster changed.
    from django.core.cache import cache

    from roster.generation import ROSTER_GENERATION_KEY

    cache.delete(ROSTER_GENERATION_KEY)
    return ids, [a.alias for a in alias_rows], segments


def run(agents: int, aliases: int, queries: int, seed_value: int) -> dict:
    from django.db import connection

    from directory.resolver import resolve

    rng = random.Random(seed_value)
    ids, alias_texts, segments = seed(agents, aliases, rng)
    mix = []
    for _ in range(queries):
        roll = rng.random()
        if roll < 0.4:
            mix.append(("agent_id", {"mention": rng.choice(ids)}))
        elif roll < 0.7:
            mix.append(("alias", {"mention": "@" + rng.choice(alias_texts)}))
        elif roll < 0.9:
            mix.append(("capability", {"mention": rng.choice(segments),
                                       "namespace": f"ns{rng.randint(0, 19)}"}))
        elif roll < 0.95:
            mix.append(("explicit_node", {"mention": rng.choice(ids),
                                          "target_node_id": f"node-{rng.randint(0, 49)}"}))
        else:
            mix.append(("miss", {"mention": f"nothing-{rng.randint(0, 10**6)}"}))
    for _, kwargs in mix[:200]:  # warm caches and the connection
        resolve(**kwargs)
    timings: dict[str, list[float]] = {}
    for kind, kwargs in mix:
        started = time.perf_counter()
        resolve(**kwargs)
        timings.setdefault(kind, []).append((time.perf_counter() - started) * 1000)
    every = sorted(t for values in timings.values() for t in values)

    def pct(values: list[float], p: float) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, int(len(values) * p))]

    return {
        "database": connection.vendor, "agents": agents, "aliases": aliases,
        "queries": queries, "p50_ms": round(statistics.median(every), 3),
        "p99_ms": round(pct(every, 0.99), 3), "max_ms": round(every[-1], 3),
        "by_kind": {k: {"n": len(v), "p50_ms": round(statistics.median(v), 3),
                        "p99_ms": round(pct(v, 0.99), 3)} for k, v in sorted(timings.items())},
        "goal_p99_ms": 2.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--aliases", type=int, default=2_000)
    parser.add_argument("--queries", type=int, default=5_000)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    setup_django()
    result = run(args.agents, args.aliases, args.queries, args.seed)
    print(f"resolve() on {result['database']}: {result['agents']} agents, "
          f"{result['aliases']} aliases, {result['queries']} queries")
    print(f"  p50 {result['p50_ms']} ms   p99 {result['p99_ms']} ms   max {result['max_ms']} ms"
          f"   (goal p99 < {result['goal_p99_ms']} ms: "
          f"{'met' if result['p99_ms'] < result['goal_p99_ms'] else 'NOT met'})")
    for kind, figures in result["by_kind"].items():
        print(f"  {kind:<14} n={figures['n']:<5} p50 {figures['p50_ms']} ms  "
              f"p99 {figures['p99_ms']} ms")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"resolve-{result['database']}-{int(time.time())}.json").write_text(
        json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
