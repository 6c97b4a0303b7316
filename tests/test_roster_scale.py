"""The roster at scale: pages that page and summarise (problem rows first), and a lease
sweep that clears any number of lapsed leases set-wise, history included."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
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
