"""The numbers on the pages (PROTOCOL.md "Tasks, numbers and alarms": "The agent and node
pages show the stats above"): the agent's and the node's partials, the cluster page's cards,
and the roster's Success / p95 answer / tasks columns with their sort. Traffic is made by the
real writers (sends, the bridge's PUBACK and ACK, ingest, the sweep), which keep the numbers."""

from __future__ import annotations

import re
from datetime import timedelta
from html import unescape

import pytest
from django.contrib.auth.models import Group
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from messages import protocol
from messages.inbound import Incoming, messages_ingest
from messages.outbound import SendRequest, message_send
from messages.sweeps import deliveries_sweep
from reachconsole.core import roles
from roster.models import Agent, ClusterNode, Namespace
from roster.services import lease_deadlines_repair
from tests.conftest import logged_in, published, reader, register, staff_user

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]
MT = protocol.MessageType
PREFIX = "ooder"
HTMX = {"HX-Request": "true"}


@pytest.fixture
def viewer():
    """A member of the viewer group: sees every page, acts on nothing."""
    user = reader("vera", password="pw-vera-123")
    user.groups.add(Group.objects.get(name=roles.VIEWER))
    return logged_in(user)


def ingest(*items):
    return messages_ingest(batch=[Incoming(t, protocol.encode(e)) for t, e in items],
                           node_id="console", prefix=PREFIX)


def answer(kind: MT, for_id: str, *, agent: str, node: str, payload=None):
    header = "inReplyTo" if kind == MT.TASK_RESPONSE else "ackFor"
    env = protocol.new_envelope(
        message_type=kind, from_agent_id=agent, to_agent_id="console",
        headers={header: for_id, "replyNodeId": node, "originNodeId": node},
        payload={"ok": True, "result": 1} if payload is None else payload)
    return protocol.inbox_topic(PREFIX, "console"), env


def bridge_published(row) -> None:
    # In its own transaction, as the bridge records a PUBACK (its row lock needs one when a
    # browser test runs outside the test's transaction, on PostgreSQL).
    with transaction.atomic():
        published(row, timezone.now())


def completed(agent: str, node: str, task_id: str, *, ok: bool = True) -> None:
    """A task sent to `agent`, published, ACKed and answered (ok, or a task error)."""
    row = message_send(request=SendRequest(to=agent, task_id=task_id))
    bridge_published(row)
    ingest(answer(MT.ACK, row.message_id, agent=agent, node=node))
    ingest(answer(MT.TASK_RESPONSE, row.message_id, agent=agent, node=node,
                  payload={"ok": ok, "result": 1, "error": "boom"}))


def sent_to_expire(agent: str, task_id: str) -> None:
    """A task sent to `agent` and published that nobody answers (the sweep expires it)."""
    row = message_send(request=SendRequest(to=agent, task_id=task_id, timeout_ms=200))
    bridge_published(row)


def expire_what_is_due() -> None:
    deliveries_sweep(now=timezone.now() + timedelta(seconds=2))


def traffic_to_fin_tax() -> None:
    """Four tasks to fin.tax on node-b: two completed, one task error, one expired."""
    register("fin.tax", "node-b")
    for i in range(3):
        completed("fin.tax", "node-b", f"t-s{i}", ok=i != 2)
    sent_to_expire("fin.tax", "t-x")
    expire_what_is_due()


def rollup_reads(queries) -> int:
    return sum(1 for q in queries if "a2a_rollup" in q["sql"] and q["sql"].lstrip()
               .upper().startswith("SELECT"))


# --- the agent's numbers ----------------------------------------------------------------------
def test_the_agent_partial_counts_what_became_of_its_tasks(viewer):
    traffic_to_fin_tax()

    r = viewer.get("/messages/agents/fin.tax/stats/", headers=HTMX)

    html = r.content.decode()
    assert r.status_code == 200 and "<html" not in html
    for key, n in (("tasks", 4), ("completed", 2), ("taskErrors", 1), ("expired", 1),
                   ("undeliverable", 0), ("nacked", 0), ("busy", 0), ("retries", 0)):
        assert f'data-count="{key}">{n}<' in html, key
    assert 'data-stat="success">50.0 %<' in html
    assert "2 completed of 4 that ended" in html
    # Each count opens its tasks in the window (since = the window in minutes).
    assert 'href="/tasks/?status=EXPIRED&amp;agent=fin.tax&amp;since=15"' in html
    assert 'href="/tasks/?status=TASK_ERROR&amp;agent=fin.tax&amp;since=15"' in html
    assert 'href="/tasks/?agent=fin.tax&amp;since=15"' in html
    # Approximate percentiles, said in words with their bucket and the bounds.
    ack = html.split('data-latency="ack"')[1].split("</tr>")[0]
    assert 'data-p="p95" data-ms="' in ack
    assert re.search(r"p95 lies (between \S+ ms and|under|above) \S+ m?s", ack)
    answered = html.split('data-latency="answer"')[1].split("</tr>")[0]
    assert re.search(r"p50 lies (between|under|above) ", answered) and "3 answers" in answered
    assert "The percentiles are approximate" in html
    assert 'data-bounds="ack">5 ms, 10 ms, 25 ms' in html
    assert 'data-bounds="answer">10 ms, 25 ms, 50 ms' in html
    # The root refreshes itself from the stream, in the window it shows.
    assert 'hx-get="/messages/agents/fin.tax/stats/?window=15m"' in html
    assert "reach:changed from:body" in html


def test_the_agent_partial_reads_the_window_asked_for(viewer):
    traffic_to_fin_tax()

    html = viewer.get("/messages/agents/fin.tax/stats/", {"window": "1h"}).content.decode()

    assert 'data-window="1h" aria-current="true"' in html
    assert 'data-count="tasks">4<' in html
    assert 'href="/tasks/?status=EXPIRED&amp;agent=fin.tax&amp;since=60"' in html
    assert 'hx-push-url="/agents/fin.tax/?window=6h"' in html  # the picker keeps the page's
    quiet = viewer.get("/messages/agents/llm.other/stats/").content.decode()
    assert 'data-count="tasks">0<' in quiet and 'data-stat="success">—<' in quiet


def test_the_agent_page_loads_its_numbers(viewer):
    register("fin.tax", "node-b")

    page = viewer.get("/agents/fin.tax/").content.decode()
    windowed = viewer.get("/agents/fin.tax/", {"window": "6h"}).content.decode()

    assert 'id="agent-stats" hx-get="/messages/agents/fin.tax/stats/"' in page
    assert 'href="/messages/agents/fin.tax/stats/"' in page  # works without JavaScript
    assert 'hx-get="/messages/agents/fin.tax/stats/?window=6h"' in windowed


# --- the node's numbers and the cluster page's cards ------------------------------------------
def test_the_node_partial_counts_the_tasks_of_its_agents(viewer):
    traffic_to_fin_tax()

    html = viewer.get("/messages/nodes/node-b/stats/", {"window": "1h"}).content.decode()

    assert 'data-count="tasks">4<' in html and 'data-count="expired">1<' in html
    assert 'data-stat="success">50.0 %<' in html
    assert 'href="/tasks/?status=EXPIRED&amp;node=node-b&amp;since=60"' in html
    assert "hx-push-url" not in html  # the cluster page has no window in its address


def test_the_cluster_cards_get_their_numbers_in_one_read(viewer):
    traffic_to_fin_tax()
    register("llm.chat", "node-a")
    register("ops.quiet", "node-c")
    b, a = (ClusterNode.objects.get(node_id=n).pk for n in ("node-b", "node-a"))

    page = viewer.get("/cluster/").content.decode()
    loader = page.split('id="nodes-stats-loader"')[1].split(">")[0]
    assert 'hx-get="/messages/nodes/stats/?node=node-a&amp;node=node-b&amp;node=node-c"' in loader
    assert f'id="node-stats-{b}" data-node-stats="node-b" hx-preserve' in page

    with CaptureQueriesContext(connection) as queries:
        r = viewer.get("/messages/nodes/stats/",
                       {"node": ["node-a", "node-b", "node-c", "node-gone"]}, headers=HTMX)
    html = r.content.decode()
    assert r.status_code == 200
    assert rollup_reads(queries.captured_queries) == 1  # one read for every card
    card_b = html.split(f'id="node-stats-{b}" hx-swap-oob="innerHTML"')[1].split("</div>")[0]
    assert 'data-node-stat="tasks">4<' in card_b
    assert 'data-node-stat="success">50.0 %<' in card_b
    assert 'data-node-stat="expired">1<' in card_b
    assert 'data-node-stat="p95">≈ ' in card_b and "(approximate: it lies " in card_b
    assert 'href="/tasks/?status=EXPIRED&amp;node=node-b&amp;since=15"' in card_b
    card_a = html.split(f'id="node-stats-{a}" hx-swap-oob="innerHTML"')[1].split("</div>")[0]
    assert 'data-node-stat="tasks">0<' in card_a and 'data-node-stat="success">—<' in card_a
    assert "node-gone" not in html  # not on the page: no card to fill


# --- the roster's columns and sort ------------------------------------------------------------
def bulk_agents(count: int, node_id: str = "node-a") -> None:
    """`count` routable agents fin.a00000…, inserted in bulk as an import would."""
    ns = Namespace.objects.get_or_create(name="fin")[0]
    node = ClusterNode.objects.get_or_create(node_id=node_id)[0]
    now = timezone.now()
    Agent.objects.bulk_create([
        Agent(namespace=ns, name=f"a{i:05d}", agent_id=f"fin.a{i:05d}", segment=f"a{i:05d}",
              node=node, lease_expires_at=now + timedelta(minutes=5), last_heartbeat_at=now)
        for i in range(count)])
    lease_deadlines_repair()


def rows(html: str) -> list[str]:
    return [part.split('"', 1)[0] for part in html.split('<tr data-agent="')[1:]]


def next_link(html: str) -> str:
    return html.split('id="next-page"')[0].rsplit('href="?', 1)[1].split('"', 1)[0].replace(
        "&amp;", "&")


def test_the_roster_sorts_by_success_across_the_whole_roster(viewer):
    bulk_agents(130)  # two pages of 100
    # Far down the default order (by id), so only a sort over every agent puts it first.
    sent_to_expire("fin.a00120", "t-f1")
    sent_to_expire("fin.a00120", "t-f2")
    completed("fin.a00060", "node-a", "t-h1")
    sent_to_expire("fin.a00060", "t-h2")
    completed("fin.a00003", "node-a", "t-g1")
    expire_what_is_due()

    with CaptureQueriesContext(connection) as queries:
        first = viewer.get("/", {"sort": "success"}).content.decode()
    assert rollup_reads(queries.captured_queries) == 1
    assert len(queries.captured_queries) < 30  # a page's worth, never one per agent

    shown = rows(first)
    assert shown[:3] == ["fin.a00120", "fin.a00060", "fin.a00003"]  # 0 %, 50 %, 100 %
    assert shown[3:6] == ["fin.a00000", "fin.a00001", "fin.a00002"]  # no traffic: after
    assert 'aria-sort="ascending"' in first and "by success rate, lowest first" in first
    row = first.split('<tr data-agent="fin.a00120"')[1].split("</tr>")[0]
    assert 'data-success="0.0"' in row and ">0.0 %<" in row and 'data-tasks="2"' in row
    assert 'href="/tasks/?agent=fin.a00120&amp;since=15"' in row
    # The next page keeps the sort and carries on where the first stopped.
    nxt = next_link(first)
    assert "sort=success" in nxt
    second = rows(viewer.get(f"/?{nxt}").content.decode())
    assert len(shown) + len(second) == 130 == len(set(shown + second))
    assert second[-1] == "fin.a00129"

    highest = rows(viewer.get("/", {"sort": "-success"}).content.decode())
    assert highest[:3] == ["fin.a00003", "fin.a00060", "fin.a00120"]
    by_tasks = rows(viewer.get("/", {"sort": "-tasks"}).content.decode())
    assert set(by_tasks[:2]) == {"fin.a00120", "fin.a00060"} and by_tasks[2] == "fin.a00003"
    # A live refresh (htmx, the fragment) of a sorted page stays sorted.
    live = viewer.get("/", {"sort": "success"},
                      headers={**HTMX, "HX-Target": "roster-live"}).content.decode()
    assert "<html" not in live and rows(live)[0] == "fin.a00120"
    assert 'name="sort" value="success" form="roster-filters"' in live


def test_the_sort_respects_the_filters(viewer):
    bulk_agents(5)
    register("llm.chat", "node-b")
    sent_to_expire("llm.chat", "t-l")
    sent_to_expire("fin.a00004", "t-f")
    expire_what_is_due()

    shown = rows(viewer.get("/", {"sort": "success", "namespace": "fin"}).content.decode())

    assert shown[0] == "fin.a00004" and "llm.chat" not in shown and len(shown) == 5


def test_the_roster_shows_the_numbers_of_the_page_in_one_read(viewer):
    traffic_to_fin_tax()
    register("llm.chat", "node-a")

    with CaptureQueriesContext(connection) as queries:
        html = viewer.get("/").content.decode()

    assert rollup_reads(queries.captured_queries) == 1
    assert "Success (15 m)" in html and "p95 answer (15 m)" in html and "Tasks (15 m)" in html
    assert 'href="?sort=success"' in html and 'href="?sort=-p95"' in html
    row = html.split('<tr data-agent="fin.tax"')[1].split("</tr>")[0]
    assert ">50.0 %<" in row and 'data-tasks="4"' in row and ">≈ " in row
    quiet = html.split('<tr data-agent="llm.chat"')[1].split("</tr>")[0]
    assert 'data-success=""' in quiet and 'data-tasks="0"' in quiet
    # A sort it does not know is the default order, not an error.
    assert viewer.get("/", {"sort": "nonsense"}).status_code == 200


def test_a_sort_cursor_it_cannot_read_is_the_first_page(viewer):
    bulk_agents(3)
    for cursor in ("nonsense", "s|0|nan|fin.a00001", "s|2|1|x", "s|0|x|y", "1|fin.a00001"):
        r = viewer.get("/", {"sort": "p95", "after": cursor})
        assert r.status_code == 200 and len(rows(r.content.decode())) == 3, cursor


# --- access and bad input ---------------------------------------------------------------------
PARTIALS = ("/messages/agents/fin.tax/stats/", "/messages/nodes/node-b/stats/",
            "/messages/nodes/stats/?node=node-b")


def test_a_viewer_sees_the_numbers_and_anyone_else_is_refused(client, viewer):
    register("fin.tax", "node-b")
    # May read the roster and the cluster, not the messages: no numbers.
    nobody = logged_in(staff_user("nora", "view_agent", "view_clusternode"))
    for path in PARTIALS:
        assert viewer.get(path).status_code == 200, path
        anonymous = client.get(path)
        assert anonymous.status_code == 302, path
        assert anonymous["Location"].startswith("/accounts/login/")
        refused = nobody.get(path, headers=HTMX)
        assert refused.status_code == 403, path
        assert 'data-error-status="403"' in refused.content.decode()
    # Without the permission the pages say why the numbers are missing, and do not ask.
    roster = nobody.get("/", {"sort": "success"}).content.decode()
    assert 'data-not-allowed="numbers"' in roster and "Success (15 m)" not in roster
    agent_page = nobody.get("/agents/fin.tax/").content.decode()
    assert 'data-not-allowed="numbers"' in agent_page and "/stats/" not in agent_page
    assert "nodes-stats-loader" not in nobody.get("/cluster/").content.decode()


def test_an_unknown_window_is_refused_with_words(viewer):
    for path in ("/messages/agents/fin.tax/stats/", "/messages/nodes/node-b/stats/"):
        r = viewer.get(path, {"window": "2d"}, headers=HTMX)
        html = unescape(r.content.decode())
        assert r.status_code == 400, path
        assert 'data-error-status="400"' in html
        assert "There is no window '2d': choose one of 5m, 15m, 1h, 6h, 24h." in html


@pytest.mark.parametrize("path", [
    "/messages/agents/fin.tax%00x/stats/", "/messages/agents/" + "a" * 300 + "/stats/",
    "/messages/nodes/node%00b/stats/", "/messages/nodes/" + "n" * 200 + "/stats/",
    "/messages/nodes/stats/?node=" + "n" * 200, "/messages/nodes/stats/?node=a%00b",
    "/messages/agents/fin.tax/stats/?window=1h%00",
])
def test_an_id_that_cannot_have_numbers_is_refused_not_a_500(viewer, path):
    r = viewer.get(path, headers=HTMX)
    assert r.status_code == 400, r.content[:300]
    assert 'data-error-status="400"' in r.content.decode()
