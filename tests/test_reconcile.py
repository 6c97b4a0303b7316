"""Reconciliation: the roster against the cluster's node set, from a real HTTP authority or
the console's own node table, stored and shown; STALE nodes' agents get no work until their
node returns; missing data never makes anything STALE."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.test import Client

from directory.resolver import resolve_agent_node
from directory.routing import route_capability
from reachconsole.celery import _reconcile_at_start
from reachconsole.core.audit import AuditEntry
from roster import services
from roster.models import Agent, ClusterNode, Consistency, Reconciliation, RosterEvent
from roster.reconcile import cluster_reconcile
from tests.conftest import TOKEN, ApiClient, later, logged_in, reader, register, staff_user

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]


class Authority:
    """A node authority on a real socket: answers what the test sets, or hangs."""

    def __init__(self) -> None:
        self.status = 200
        self.body: bytes = b"[]"
        self.hang = threading.Event()
        self.release = threading.Event()
        self.requests: list[dict] = []
        authority = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server interface
                authority.requests.append(dict(self.headers))
                if authority.hang.is_set():
                    authority.release.wait(10)
                    return
                self.send_response(authority.status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(authority.body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/cluster/nodes"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def lists(self, *nodes: dict) -> None:
        self.status, self.body = 200, json.dumps(list(nodes)).encode()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def authority(settings) -> Iterator[Authority]:
    served = Authority()
    settings.REACH_CLUSTER_NODES_URL = served.url
    settings.REACH_CLUSTER_NODES_TOKEN = TOKEN
    settings.REACH_RECONCILE_TIMEOUT_S = 2.0
    yield served
    served.close()


@pytest.fixture
def cluster(now):
    """fin.tax on node-a, fin.vat on node-b, both heard just now."""
    register("fin.tax", "node-a", capabilities=["tax"], now=now)
    register("fin.vat", "node-b", capabilities=["tax"], now=now)
    for node, agent in (("node-a", "fin.tax"), ("node-b", "fin.vat")):
        services.heartbeat_record(node_id=node, agents=[{"agentId": agent}], heartbeat_ms=5000,
                                  now=now)


def classes() -> dict[str, str]:
    return dict(ClusterNode.objects.values_list("node_id", "consistency"))


def run(**kwargs) -> Reconciliation:
    return cluster_reconcile(trigger=Reconciliation.Trigger.SCHEDULE, **kwargs)


def test_a_node_the_authority_drops_is_stale_and_unroutable_until_it_returns(authority, cluster,
                                                                             now):
    authority.lists({"nodeId": "node-a", "status": "ONLINE"}, {"nodeId": "node-b"})
    first = run(now=now)
    assert classes() == {"node-a": "OK", "node-b": "OK"}
    assert first.authority == authority.url and first.authority_ok
    assert first.counts == {"OK": 2, "STALE": 0, "UNKNOWN": 0}
    # It is fetched with the service token and a source the authority trusts.
    assert authority.requests[-1]["Authorization"] == f"Bearer {TOKEN}"
    assert ApiClient().get("/api/cluster/nodes").status_code == 200  # that shape, served here

    authority.lists({"nodeId": "node-a", "status": "ONLINE"})
    dropped = run(now=now)
    assert classes() == {"node-a": "OK", "node-b": "STALE"}
    assert dropped.changes == [{"nodeId": "node-b", "from": "OK", "to": "STALE",
                                "reason": "node node-b is not in the cluster's node set"}]
    refused = resolve_agent_node(to_agent_id="fin.vat", now=now)
    assert not refused.ok and "STALE" in refused.reason
    # Capability routing passes it over for the agent whose node is listed.
    for _ in range(4):
        assert route_capability(capability="tax", now=now).agent_id == "fin.tax"
    rows = {r["agentId"]: r for r in ApiClient().get("/api/ops/roster-consistency").json()}
    assert rows["fin.vat"]["status"] == "STALE" and rows["fin.tax"]["status"] == "OK"

    authority.lists({"nodeId": "node-a"}, {"nodeId": "node-b", "status": "ONLINE"})
    back = run(now=now)
    assert classes() == {"node-a": "OK", "node-b": "OK"}
    assert [c["to"] for c in back.changes] == ["OK"]
    assert resolve_agent_node(to_agent_id="fin.vat", now=now).ok


def test_a_node_the_authority_reports_down_or_retired_is_stale(authority, cluster, now):
    authority.lists({"nodeId": "node-a", "status": "DOWN"}, {"nodeId": "node-b", "retired": True})
    run(now=now)
    assert classes() == {"node-a": "STALE", "node-b": "STALE"}
    reason = ClusterNode.objects.get(node_id="node-a").consistency_reason
    assert "reports node node-a DOWN" in reason


@pytest.mark.parametrize(("status", "body", "words"), [
    (200, b'{"nodes": []}', "answered nonsense: expected a JSON list"),
    (200, b"<html>proxy error</html>", "answered nonsense"),
    (200, b'[{"nodeId": "+/#"}]', "answered nonsense: entry 0 has no valid nodeId"),
    (200, b"[]", "an empty node set while the roster holds agents"),
    (503, b"{}", "answered HTTP 503"),
])
def test_an_authority_answering_nonsense_marks_nothing_stale(authority, cluster, now, status,
                                                               body, words):
    authority.lists({"nodeId": "node-a"}, {"nodeId": "node-b"})
    run(now=now)
    authority.status, authority.body = status, body
    result = run(now=now)
    assert not result.authority_ok and words in result.detail
    assert classes() == {"node-a": "UNKNOWN", "node-b": "UNKNOWN"}
    assert result.counts == {"OK": 0, "STALE": 0, "UNKNOWN": 2}
    # UNKNOWN is not a verdict against the agents: they keep getting work.
    assert resolve_agent_node(to_agent_id="fin.vat", now=now).ok


def test_an_unreachable_authority_marks_nothing_stale(settings, cluster, now):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        settings.REACH_CLUSTER_NODES_URL = f"http://127.0.0.1:{sock.getsockname()[1]}/nodes"
    result = run(now=now)
    assert not result.authority_ok and "could not be reached" in result.detail
    assert set(classes().values()) == {"UNKNOWN"}


@pytest.mark.django_db(transaction=True)
def test_the_start_check_gives_up_on_a_hanging_authority_and_says_unknown(authority, cluster,
                                                                           settings):
    settings.REACH_RECONCILE_TIMEOUT_S = 0.3
    authority.hang.set()
    done = threading.Event()

    def start():
        _reconcile_at_start()
        done.set()

    worker = threading.Thread(target=start)
    worker.start()
    worker.join(30)
    assert done.is_set(), "the start check did not give up on a hanging authority"
    startup = Reconciliation.objects.get(trigger=Reconciliation.Trigger.STARTUP)
    assert not startup.authority_ok and "timed out" in startup.detail
    assert set(classes().values()) == {"UNKNOWN"}


def test_without_an_authority_the_roster_and_heartbeats_decide(cluster, now):
    register("fin.new", "node-c", now=now)  # registered, never heard
    result = run(now=now)
    assert result.authority == "roster"
    assert classes() == {"node-a": "OK", "node-b": "OK", "node-c": "UNKNOWN"}
    # Silent for three heartbeat intervals: STALE (and its agents no work).
    quiet = later(now, 3 * 5000 + 1)
    services.node_seen(node_id="node-a", now=quiet)
    run(now=quiet)
    assert classes()["node-b"] == "STALE" and classes()["node-a"] == "OK"
    assert "silent for 15 s" in ClusterNode.objects.get(node_id="node-b").consistency_reason
    # Its heartbeat brings it back at once, without waiting for the next run.
    services.heartbeat_record(node_id="node-b", agents=[{"agentId": "fin.vat"}], now=quiet)
    assert classes()["node-b"] == "OK"
    # A retired node is STALE whatever it sends.
    services.node_retire(node_id="node-b")
    services.heartbeat_record(node_id="node-b", agents=[{"agentId": "fin.vat"}], now=quiet)
    assert classes()["node-b"] == "STALE"
    run(now=quiet)
    assert ClusterNode.objects.get(node_id="node-b").consistency_reason == "node node-b is retired"


def test_a_console_that_did_not_hear_the_bus_judges_no_silence(cluster, now):
    from roster.models import BusHearing

    BusHearing.objects.all().delete()  # no bridge hears: the console is deaf, not the nodes
    run(now=later(now, 60_000))
    assert set(classes().values()) == {"UNKNOWN"}
    assert "not heard the bus long enough" in ClusterNode.objects.get(
        node_id="node-b").consistency_reason


@pytest.mark.django_db(transaction=True)
def test_two_runs_at_once_record_each_change_once(authority, cluster, now):
    from tests.conftest import run_at_once

    authority.lists({"nodeId": "node-a"})
    run_at_once(lambda: run(now=now))
    changes = [c for r in Reconciliation.objects.all() for c in r.changes]
    assert [(c["nodeId"], c["to"]) for c in changes].count(("node-b", "STALE")) == 1
    assert [(c["nodeId"], c["to"]) for c in changes].count(("node-a", "OK")) == 1


# --- the cluster page ---------------------------------------------------------------------------

@pytest.fixture
def operator() -> Client:
    return logged_in(staff_user("olga", "reconcile_cluster", "manage_node"))


def test_an_operator_reconciles_from_the_cluster_page_and_it_is_audited(operator, authority,
                                                                          cluster):
    authority.lists({"nodeId": "node-a"})
    page = operator.get("/cluster/").content.decode()
    assert "Reconciliation has not run yet" in page and 'id="reconcile"' in page
    done = operator.post("/cluster/reconcile", follow=True).content.decode()
    assert "1 node changed class" in done or "2 nodes changed class" in done
    assert 'data-change="node-b"' in done and "not in the cluster&#x27;s node set" in done
    entry = AuditEntry.objects.get(action="reconcile")
    assert entry.actor == "olga" and "STALE 1" in entry.detail
    assert Reconciliation.objects.get().trigger == Reconciliation.Trigger.OPERATOR


def test_a_viewer_cannot_reconcile_drain_or_retire_a_node(client, cluster):
    client.force_login(reader("victor", password="pw-victor-123"))
    page = client.get("/cluster/").content.decode()
    assert 'id="reconcile"' not in page and "data-retire-node" not in page
    assert client.post("/cluster/reconcile").status_code == 403
    assert client.post("/cluster/nodes/node-a/drain").status_code == 403
    assert client.post("/cluster/nodes/node-a/retire").status_code == 403
    assert not Reconciliation.objects.exists()
    assert not ClusterNode.objects.filter(retired=True).exists()


def test_an_operator_drains_and_retires_a_whole_node(operator, cluster):
    register("fin.more", "node-a")
    r = operator.post("/cluster/nodes/node-a/drain", follow=True)
    assert "2 agent(s) now draining" in r.content.decode()
    assert set(Agent.objects.filter(node__node_id="node-a").values_list("status", flat=True)) == {
        Agent.Status.DRAINING}
    assert Agent.objects.get(agent_id="fin.vat").status == Agent.Status.ONLINE
    drained = AuditEntry.objects.get(action="drain-node")
    assert (drained.target, drained.actor, drained.detail) == ("node-a", "olga",
                                                               "2 agent(s) draining")
    assert RosterEvent.objects.filter(kind="DRAINED", node_id="node-a").count() == 2
    again = operator.post("/cluster/nodes/node-a/drain", follow=True).content.decode()
    assert "0 agent(s) now draining" in again  # already draining: nothing twice
    operator.post("/cluster/nodes/node-a/retire", {"retired": "1"})
    node = ClusterNode.objects.get(node_id="node-a")
    assert node.retired and node.consistency == Consistency.STALE
    operator.post("/cluster/nodes/node-a/retire", {"retired": "0"})
    assert not ClusterNode.objects.get(node_id="node-a").retired
    assert AuditEntry.objects.filter(action__in=["retire-node", "unretire-node"]).count() == 2
    missing = operator.post("/cluster/nodes/nowhere/retire", follow=True).content.decode()
    assert "nowhere" in missing
    assert AuditEntry.objects.get(action="retire-node", target="nowhere").result == "refused"


def test_a_conflict_shows_under_both_nodes_and_on_the_agent(operator, cluster, now):
    # node-b lists fin.tax, which the roster places on node-a.
    services.heartbeat_record(node_id="node-b", agents=[{"agentId": "fin.tax"}])
    page = operator.get("/cluster/").content.decode()
    for node in ("node-a", "node-b"):
        section = page.split(f'id="node-{node}"')[1].split("</section>")[0]
        assert 'data-conflict="fin.tax"' in section
    agent_page = operator.get("/agents/fin.tax/").content.decode()
    assert 'data-conflict="node-b"' in agent_page
    assert Agent.objects.get(agent_id="fin.tax").node.node_id == "node-a"  # not moved


def test_the_consoles_own_node_is_not_drained_from_the_page(operator, settings):
    register("fin.tax", "node-a")
    ClusterNode.objects.get_or_create(node_id=settings.REACH_NODE_ID)
    r = operator.post(f"/cluster/nodes/{settings.REACH_NODE_ID}/drain", follow=True)
    assert "the console&#x27;s own node" in r.content.decode()
    assert AuditEntry.objects.get(action="drain-node").result == "refused"


def test_old_conflicts_are_no_longer_shown(operator, cluster, now):
    services.heartbeat_record(node_id="node-b", agents=[{"agentId": "fin.tax"}],
                              now=now - timedelta(minutes=5))
    assert "data-conflict" not in operator.get("/cluster/").content.decode()


def test_a_heartbeat_over_http_brings_a_silent_node_back_too(cluster, now, api):
    quiet = later(now, 3 * 5000 + 1)
    run(now=quiet)
    assert classes()["node-b"] == "STALE"
    r = api.post("/api/roster/agents/fin.vat/heartbeat", {"nodeId": "node-b"})
    assert r.status_code == 200, r.content
    assert classes()["node-b"] == "OK"


def test_quiet_runs_are_kept_an_hour_and_runs_that_changed_something_longer(cluster, now):
    old = now - timedelta(hours=2)
    quiet = Reconciliation.objects.create(started_at=old, trigger="schedule", authority="roster")
    eventful = Reconciliation.objects.create(
        started_at=old, trigger="schedule", authority="roster",
        changes=[{"nodeId": "node-a", "from": "UNKNOWN", "to": "OK", "reason": "live"}])
    run(now=now)
    left = set(Reconciliation.objects.values_list("pk", flat=True))
    assert quiet.pk not in left and eventful.pk in left and len(left) == 2
