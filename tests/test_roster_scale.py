"""The roster at scale: pages that page and summarise (problem rows first), and a lease
sweep that clears any number of lapsed leases set-wise, history included."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import IntegrityError, connection, transaction
from django.test import Client
from django.utils import timezone

from roster import services
from roster.models import Agent, ClusterNode, Namespace, RosterEvent
from tests.conftest import later, register

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]


@pytest.fixture
def viewer() -> Client:
    client = Client()
    client.force_login(User.objects.create_user("victor", password="pw-victor-123"))
    return client


def bulk_roster(count: int, *, node_id: str = "node-a", offline_every: int = 0) -> None:
    """`count` agents, as many registrations would leave them (inserted in bulk)."""
    ns = Namespace.objects.get_or_create(name="fin")[0]
    node = ClusterNode.objects.get_or_create(node_id=node_id)[0]
    now = timezone.now()
    Agent.objects.bulk_create([
        Agent(namespace=ns, name=f"a{i:05d}", agent_id=f"fin.a{i:05d}", segment=f"a{i:05d}",
              node=node, lease_expires_at=now + timedelta(minutes=5), last_heartbeat_at=now,
              status=(Agent.Status.OFFLINE if offline_every and i % offline_every == 0
                      else Agent.Status.ONLINE))
        for i in range(count)
    ], batch_size=1000)


def rows(html: str) -> list[str]:
    return [part.split('"', 1)[0] for part in html.split('data-agent="')[1:]]


def test_the_roster_page_pages_by_cursor_with_the_problem_rows_first(viewer):
    bulk_roster(250, offline_every=50)  # five OFFLINE: a00000, a00050, …
    first = viewer.get("/").content.decode()
    shown = rows(first)
    assert len(shown) == 100
    assert shown[:5] == [f"fin.a{i:05d}" for i in range(0, 250, 50)]
    assert shown[5] == "fin.a00001"
    assert "100 of 250 agents" in first
    nxt = first.split('id="next-page"')[0].rsplit('href="?', 1)[1].split('"', 1)[0]
    second = viewer.get(f"/?{nxt.replace('&amp;', '&')}").content.decode()
    third_link = second.split('id="next-page"')[0].rsplit('href="?', 1)[1].split('"', 1)[0]
    third = viewer.get(f"/?{third_link.replace('&amp;', '&')}").content.decode()
    seen = shown + rows(second) + rows(third)
    assert len(seen) == len(set(seen)) == 250  # nothing skipped, nothing twice
    assert 'id="next-page"' not in third and 'id="first-page"' in third


def test_the_cursor_keeps_the_filters(viewer):
    bulk_roster(150)
    bulk_roster(0, node_id="node-b")
    register("fin.other", "node-b")
    page = viewer.get("/", {"node": "node-a"}).content.decode()
    assert "node=node-a" in page.split('id="next-page"')[0].rsplit('href="?', 1)[1]
    assert "fin.other" not in page


def test_a_bad_cursor_is_the_first_page_not_an_error(viewer):
    bulk_roster(3)
    for cursor in ("nonsense", "7|x", "|", "1|" + "z" * 400):
        r = viewer.get("/", {"after": cursor})
        assert r.status_code == 200


def test_the_cluster_page_summarises_each_node(viewer):
    bulk_roster(300, offline_every=10)  # 30 OFFLINE on node-a
    page = viewer.get("/cluster/").content.decode()
    section = page.split('id="node-node-a"')[1].split("</section>")[0]
    assert section.count("data-problem=") == 10  # the first ten, not all thirty
    assert 'data-node-count="offline">30<' in section
    assert 'data-node-count="online">270<' in section
    assert "30 in all that need attention" in section
    assert "fin.a00001" not in section  # a healthy agent is counted, not listed


def test_a_stale_agent_is_a_problem_row(viewer, now):
    register("fin.quiet", "node-a", now=now - timedelta(minutes=10))
    register("fin.loud", "node-a")
    page = viewer.get("/cluster/").content.decode()
    assert 'data-problem="fin.quiet"' in page and 'data-problem="fin.loud"' not in page


@pytest.mark.django_db(transaction=True)
def test_the_lease_sweep_clears_every_lapsed_lease_in_batches_with_its_history(settings, now):
    bulk_roster(2_500)
    Agent.objects.filter(agent_id__endswith="7").update(status=Agent.Status.DRAINING)
    draining = Agent.objects.filter(status=Agent.Status.DRAINING).count()
    moment = later(now, 10 * 60 * 1000)
    counts = services.leases_expire(now=moment, batch=1_000)  # three batches
    assert (counts.offline, counts.removed) == (2_500 - draining, draining)
    assert not Agent.objects.filter(status__in=["ONLINE", "DRAINING"]).exists()
    assert RosterEvent.objects.filter(kind="EXPIRED", actor="sweeper").count() == 2_500 - draining
    removed = RosterEvent.objects.filter(kind="REMOVED")
    assert removed.count() == draining
    assert set(removed.values_list("node_id", flat=True)) == {"node-a"}
    assert services.leases_expire(now=moment) == services.ExpiryCounts(0, 0)


# Every index of roster_agent, by the columns it covers. The lease sweep rewrites each lapsed
# row and pays for every index here (docs/performance.md), so one more is a decision: add it
# here with the query that reads it (roster/models.py says which query reads which index).
AGENT_INDEXES = {
    ("id",), ("agent_id",), ("namespace_id",), ("node_id",), ("segment",),
    ("lease_expires_at",), ("status", "last_heartbeat_at"),
}


def test_the_roster_keeps_only_the_indexes_its_queries_read():
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, Agent._meta.db_table)
    indexed = {tuple(c["columns"]) for c in found.values()
               if c["index"] or c["unique"] or c["primary_key"]}
    assert indexed == AGENT_INDEXES
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s",
                           [Agent._meta.db_table])
            defs = dict(cursor.fetchall())
        # No LIKE-prefix index (unique=True or db_index=True on a CharField adds one).
        assert not [name for name, sql in defs.items() if "pattern_ops" in sql]
        # The lapse index holds only the rows that can still lapse: a row the sweep takes
        # OFFLINE writes no entry into it.
        assert "WHERE" in defs["agent_lease_live"] and "OFFLINE" not in defs["agent_lease_live"]


def test_an_agent_id_stays_unique_without_its_unique_field_flag(now):
    register("fin.tax", now=now)
    with pytest.raises(IntegrityError), transaction.atomic():
        Agent.objects.create(namespace=Namespace.objects.get(), name="tax", agent_id="fin.tax",
                             node=ClusterNode.objects.get(), lease_expires_at=now)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL plans only")
def test_the_sweep_claims_through_the_lapse_index_and_changes_rows_by_key(now):
    """The claim's WHERE must imply the partial index's predicate (PostgreSQL uses the index
    only then), and the update and delete must find their rows from the claimed keys, not
    join the claim against the whole roster (a hash join reads every agent, each batch). On
    a table this small the planner would rather scan, so scans are priced out to see which
    paths the statement allows at all."""
    bulk_roster(50)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN (COSTS OFF) " + services._EXPIRE_SQL,
                       {"now": later(now, 10 * 60 * 1000), "batch": 20})
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    assert "Index Scan using agent_lease_live on roster_agent" in plan
    changes = plan.split("CTE went_offline", 1)[1].split("CTE history", 1)[0]
    assert changes.count("id = ANY") == 2  # the update, the delete: by the claimed keys
    assert "Join" not in changes and "Nested Loop" not in changes


def test_the_api_pages_the_roster_with_a_cursor(api):
    bulk_roster(250)
    seen, url, pages = [], "/api/roster/agents?limit=100&namespace=fin", 0
    while url:
        r = api.client.get(url, headers=api.headers)
        assert r.status_code == 200 and r.headers["X-Total-Count"] == "250"
        seen += [a["agentId"] for a in r.json()]
        pages += 1
        link = r.headers.get("Link", "")
        url = link[1:link.index(">")] if link else ""
        if url:
            assert r.headers["X-Next-Cursor"] == seen[-1] and "namespace=fin" in url
    assert pages == 3 and seen == sorted(seen) and len(set(seen)) == 250
    last = api.get("/api/roster/agents", {"after": "fin.a00249"})
    assert last.status_code == 200 and last.json() == [] and "Link" not in last.headers
