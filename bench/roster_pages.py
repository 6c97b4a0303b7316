"""What the roster pages and API cost at 10,000 agents against 100.

Goal: at most 3× for the roster page and its live fragment, the cluster page and its live
fragment, and the first page of `GET /api/roster/agents`. Served in process by Django's test
client (the view, its queries and its template: what a request costs the server), against
`reachconsole_bench` on PostgreSQL (bench/common.py), never a database the tests use.

    .venv/bin/python bench/roster_pages.py [--small 100] [--large 10000] [--repeat 30] [--strict]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta

import common

TOKEN = "bench-token-roster-pages"
PAGES = {
    "roster page": ("/", {}),
    "roster fragment": ("/", {"HTTP_HX_REQUEST": "true", "HTTP_HX_TARGET": "roster-live"}),
    "cluster page": ("/cluster/", {}),
    "cluster fragment": ("/cluster/", {"HTTP_HX_REQUEST": "true", "HTTP_HX_TARGET": "nodes-live"}),
    "API first page": ("/api/roster/agents?limit=100", {
        "HTTP_AUTHORIZATION": f"Bearer {TOKEN}", "HTTP_X_OODER_SOURCE": "studio"}),
}


def seed(agents: int) -> None:
    """A roster of `agents` on 20 nodes, one in twenty OFFLINE (bulk insert)."""
    from django.db import connection
    from django.utils import timezone

    from roster.models import Agent, ClusterNode, Namespace

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE roster_leasedeadline, roster_agent, roster_rosterevent")
    ns = Namespace.objects.get_or_create(name="bench")[0]
    nodes = [ClusterNode.objects.get_or_create(node_id=f"bench-node-{i}")[0] for i in range(20)]
    now = timezone.now()
    Agent.objects.bulk_create([
        Agent(namespace=ns, name=f"a{i}", agent_id=f"bench.a{i}", segment=f"a{i}",
              node=nodes[i % len(nodes)], capabilities=[f"skill{i % 50}"],
              lease_expires_at=now + timedelta(hours=1), last_heartbeat_at=now,
              status=Agent.Status.OFFLINE if i % 20 == 0 else Agent.Status.ONLINE)
        for i in range(agents)
    ], batch_size=5000)


def measure(client, repeat: int) -> dict[str, float]:
    out = {}
    for name, (path, headers) in PAGES.items():
        times = []
        for _ in range(repeat + 3):
            started = time.perf_counter()
            response = client.get(path, **headers)
            times.append(time.perf_counter() - started)
            assert response.status_code == 200, (name, response.status_code)
        out[name] = statistics.median(times[3:]) * 1000  # the first three warm caches
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=100)
    ap.add_argument("--large", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--strict", action="store_true", help="exit 2 when a goal is not met")
    args = ap.parse_args(argv)
    common.django_setup(channel_prefix=common.run_tag("pages"))
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.test import Client

    from reachconsole.core.tokens import tokens_parse

    settings.REACH_SERVICE_TOKENS = tokens_parse([TOKEN])
    settings.REACH_JUDGE_BY_CLOCK = True
    settings.ALLOWED_HOSTS = ["*"]
    user = User.objects.filter(username="bench-viewer").first() or User.objects.create_user(
        "bench-viewer", password="bench-viewer-pw")
    # A viewer: an account in no role sees only the page that says whom to ask.
    from django.contrib.auth.models import Group

    from reachconsole.core.roles import VIEWER

    user.groups.add(Group.objects.get(name=VIEWER))
    client = Client()
    client.force_login(user)
    results = {}
    for size in (args.small, args.large):
        seed(size)
        results[size] = measure(client, args.repeat)
    rows, met = [], True
    for name in PAGES:
        small, large = results[args.small][name], results[args.large][name]
        ratio = large / small
        met &= ratio <= 3.0
        rows.append([name, f"{small:.1f}", f"{large:.1f}", f"{ratio:.2f}×"])
    print(common.table(["request", f"{args.small} agents (ms)", f"{args.large} agents (ms)",
                        "ratio"], rows))
    print(f"\ngoal: at most 3× at {args.large:,} agents: {'met' if met else 'NOT MET'}")
    path = common.write_result("roster-pages", {"results": results, "goal_met": met,
                                                "machine": common.machine()})
    print(f"written to {path.relative_to(common.ROOT)}")
    return 2 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
