"""The roster at scale: pages that page and summarise (problem rows first), and a lease
sweep that clears any number of lapsed leases set-wise, history included."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.test import Client
from django.utils import timezone

from roster import services
from roster.models import Agent, ClusterNode, Namespace, RosterEvent
from tests.conftest import later, reader, register

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]


@pytest.fixture
def viewer() -> Client:
    client = Client()
    client.force_login(reader("victor", password="pw-victor-123"))
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
    # Written around the services, as an import would: the repair gives them their sweep
    # deadlines, as its periodic task would.
    assert services.lease_deadlines_repair() == count - (
        len(range(0, count, offline_every)) if offline_every else 0)


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
    # Three batches, shared out between two connections on PostgreSQL.
    counts = services.leases_expire(now=moment, batch=1_000, workers=2)
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
}
# What the lease sweep writes: no index may mention any of them, or its update is not HOT.
SWEEP_WRITES = {"status", "expired_at", "inflight", "updated_at"}


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
            cursor.execute("SELECT reloptions FROM pg_class WHERE relname = %s",
                           [Agent._meta.db_table])
            options = cursor.fetchone()[0]
        # No LIKE-prefix index (unique=True or db_index=True on a CharField adds one).
        assert not [name for name, sql in defs.items() if "pattern_ops" in sql]
        # Neither in a key nor in a partial index's predicate.
        assert not [name for name, sql in defs.items()
                    if any(column in sql for column in SWEEP_WRITES)]
        # Room on each page for the new versions the sweep writes there.
        assert options == ["fillfactor=45"]
        # The history: two btree entries a row, and a BRIN for time ranges.
        with connection.cursor() as cursor:
            cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s",
                           [RosterEvent._meta.db_table])
            history = dict(cursor.fetchall())
        assert set(history) == {"roster_rosterevent_pkey", "rosterevent_agent_at",
                                "rosterevent_conflict_at", "rosterevent_at"}
        assert "USING brin (at)" in history["rosterevent_at"]
        assert "WHERE" in history["rosterevent_conflict_at"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="HOT updates are PostgreSQL's")
def test_the_sweeps_update_writes_no_index_entry(now):
    bulk_roster(500)

    def updates(cursor) -> tuple[int, int]:
        # This backend's counts not yet reported, which a transaction never reports midway.
        cursor.execute("SELECT pg_stat_get_xact_tuples_updated(%s::regclass), "
                       "pg_stat_get_xact_tuples_hot_updated(%s::regclass)",
                       [Agent._meta.db_table] * 2)
        return cursor.fetchone()

    with transaction.atomic(), connection.cursor() as cursor:
        before = updates(cursor)
        counts = services.leases_expire(now=later(now, 10 * 60 * 1000))
        after = updates(cursor)
    assert counts.offline == 500
    assert (after[0] - before[0], after[1] - before[1]) == (500, 500)  # all of them HOT


def test_an_agent_id_stays_unique_without_its_unique_field_flag(now):
    register("fin.tax", now=now)
    with pytest.raises(IntegrityError), transaction.atomic():
        Agent.objects.create(namespace=Namespace.objects.get(), name="tax", agent_id="fin.tax",
                             node=ClusterNode.objects.get(), lease_expires_at=now)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL plans only")
def test_the_sweep_claims_through_the_deadlines_and_changes_rows_by_key(now):
    """The claim reads the deadlines' index, and the agents and the deadlines the statement
    changes are found by the claimed keys, never by a join against the whole roster (a hash
    join reads every agent, each batch). On a table this
    small the planner would rather scan, so scans are priced out to see which paths the
    statement allows at all."""
    bulk_roster(50)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN (COSTS OFF) " + services._EXPIRE_SQL,
                       {"now": later(now, 10 * 60 * 1000), "batch": 20})
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    claim = plan.split("CTE due", 1)[1].split("CTE seen", 1)[0]
    assert "Index Scan on roster_leasedeadline_expires_at" in claim.replace(
        "Index Scan using", "Index Scan on")
    seen = plan.split("CTE seen", 1)[1].split("CTE went_offline", 1)[0]
    assert "Index Scan on roster_agent_pkey" in seen.replace("Index Scan using", "Index Scan on")
    assert "id = ANY" in seen
    changes = plan.split("CTE went_offline", 1)[1].split("CTE moved", 1)[0]
    # The update and the delete: each by the claimed keys, through the primary key.
    assert changes.replace("Index Scan using", "Index Scan on").count(
        "Index Scan on roster_agent_pkey") == 2
    assert "Join" not in changes and "Nested Loop" not in changes
    dropped = plan.split("CTE dropped", 1)[1].split("CTE history", 1)[0]
    assert "agent_id = ANY" in dropped and "Seq Scan on roster_leasedeadline" not in dropped


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
