"""The directory: resolve()'s order, explicit nodes, candidates, the merged view, routing."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from directory.models import Alias, ProcessDefinitionBinding, ProcessInstance, SceneBinding
from directory.resolver import NOT_DELIVERABLE, NOT_FOUND, resolve
from directory.routing import group_members, route_capability
from directory.specs import specs
from messages import protocol
from messages.inbound import Incoming, messages_ingest
from messages.models import Message, Status
from messages.outbound import SendRefused, SendRequest, message_send, messages_send_group
from roster import services
from roster.models import Agent, Namespace
from tests.conftest import later, register

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]


def alias(text: str, agent_id: str, namespace: str) -> Alias:
    ns, _ = Namespace.objects.get_or_create(name=namespace)
    return Alias.objects.create(alias=text, agent_id=agent_id, namespace=ns)


@pytest.fixture
def roster(now):
    register("fin.tax", "node-a", capabilities=["tax"], groups=["finance"])
    register("fin.bank-statement", "node-a", capabilities=["bank-statement"])
    register("llm.taxonomy", "node-b", capabilities=["taxonomy"])
    register("ops.accountant", "node-b", capabilities=["accounting"], groups=["finance"])
    alias("资金日报", "fin.bank-statement", "fin")
    alias("tax", "ops.accountant", "ops")


def test_an_exact_agent_id_wins(roster):
    r = resolve(mention="fin.tax")
    assert (r.agent_id, r.node_id, r.level, r.match) == ("fin.tax", "node-a", "mention",
                                                          "agent_id")
    assert resolve(mention="fin/tax").agent_id == "fin.tax"


def test_an_alias_comes_before_a_capability_segment(roster):
    r = resolve(mention="@tax")
    assert (r.agent_id, r.match) == ("ops.accountant", "alias")


def test_unicode_aliases_resolve(roster):
    for text in ("@资金日报", "资金日报"):
        r = resolve(mention=text)
        assert (r.agent_id, r.node_id, r.match) == ("fin.bank-statement", "node-a", "alias")


def test_a_capability_segment_then_a_substring(roster):
    Alias.objects.filter(alias="tax").delete()
    assert (resolve(mention="tax").agent_id, resolve(mention="tax").match) == (
        "fin.tax", "capability")
    r = resolve(mention="taxon")
    assert (r.agent_id, r.match) == ("llm.taxonomy", "substring")


def test_an_explicit_node_never_falls_back(roster):
    r = resolve(mention="fin.tax", target_node_id="node-b")
    assert not r.ok and r.outcome == NOT_FOUND
    assert "never swapped" in r.reason
    assert [(c.agent_id, c.routable) for c in r.candidates] == [("fin.tax", False)]
    assert "not the explicit node node-b" in r.candidates[0].why
    ok = resolve(mention="fin.tax", target_node_id="node-a")
    assert (ok.agent_id, ok.level) == ("fin.tax", "explicit")


def test_a_miss_says_not_found_with_what_was_tried(roster):
    r = resolve(mention="nobody-here", pid="p-404", scene_id="s-404")
    assert not r.ok and r.outcome == NOT_FOUND
    assert "matched no agent id, alias, capability segment or name" in r.reason
    assert "pid p-404 has no process binding" in r.reason
    assert "scene s-404 has no binding" in r.reason


def test_found_but_not_deliverable_is_its_own_outcome(roster, now, settings):
    services.agent_drain(agent_id="fin.tax")
    r = resolve(mention="fin.tax")
    assert r.outcome == NOT_DELIVERABLE and "no match can take work now" in r.reason
    assert r.candidates[0].why == "draining: it takes no new work"
    register("web.crawl", "node-c", now=later(now, -10 * settings.REACH_HEARTBEAT_MS))
    stale = resolve(mention="web.crawl")
    assert stale.outcome == NOT_DELIVERABLE
    assert stale.candidates[0].status in {"STALE", "OFFLINE"}


def test_ties_are_deterministic_and_visible(now):
    register("fin.notify", "node-b", capabilities=["notify"])
    register("ops.notify", "node-a", capabilities=["notify"])
    first = resolve(mention="notify")
    assert first.agent_id == "fin.notify"  # equal load: by id
    assert "tie of 2" in first.candidates[0].why
    assert [c.agent_id for c in first.candidates] == ["fin.notify", "ops.notify"]
    services.agent_renew(agent_id="fin.notify", inflight=6)
    assert resolve(mention="notify").agent_id == "ops.notify"  # least loaded wins the tie
    assert resolve(mention="notify", namespace="fin").agent_id == "fin.notify"  # namespace first


def test_the_stale_namespace_never_captures_the_alias(now, settings):
    # llm.bank-statement is left behind after the namespace moved to fin.
    register("llm.bank-statement", "node-b", capabilities=["bank-statement"])
    register("fin.bank-statement", "node-a", capabilities=["bank-statement"])
    alias("资金日报", "fin.bank-statement", "fin")
    assert resolve(mention="@资金日报", namespace="fin").agent_id == "fin.bank-statement"
    assert resolve(mention="bank-statement", namespace="fin").agent_id == "fin.bank-statement"
    entry = next(e for e in specs(namespace="fin") if e.segment == "bank-statement")
    assert (entry.agent_id, entry.node_id) == ("fin.bank-statement", "node-a")
    assert [c.agent_id for c in entry.shadowed] == ["llm.bank-statement"]


def test_remote_comes_before_the_consoles_own(settings):
    register("ops.notify", settings.REACH_NODE_ID, capabilities=["notify"])
    register("web.notify", "node-r", capabilities=["notify"])
    assert resolve(mention="notify", namespace="ops").agent_id == "web.notify"
    entry = next(e for e in specs(namespace="ops") if e.segment == "notify")
    assert entry.remote is True and entry.node_id == "node-r"


def test_a_pid_resolves_through_its_process_binding(roster):
    ProcessInstance.objects.create(pid="p-1", definition_id="loan-approval")
    ProcessDefinitionBinding.objects.create(definition_id="loan-approval", agent_id="fin.tax")
    r = resolve(pid="p-1")
    assert (r.agent_id, r.level) == ("fin.tax", "pid")
    assert "definition loan-approval" in r.reason


def test_a_pid_missing_from_the_table_is_asked_over_http(roster, settings):
    class Lookup(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            body = json.dumps({"definitionId": "claims"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Lookup)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        settings.REACH_PID_LOOKUP_URL = f"http://127.0.0.1:{server.server_address[1]}/pid"
        ProcessDefinitionBinding.objects.create(definition_id="claims", agent_id="ops.accountant")
        r = resolve(pid="p-remote")
        assert (r.agent_id, r.level) == ("ops.accountant", "pid")
    finally:
        server.shutdown()


def test_a_scene_resolves_through_its_binding(roster):
    SceneBinding.objects.create(scene_id="month-end", agent_id="fin.bank-statement")
    r = resolve(scene_id="month-end")
    assert (r.agent_id, r.level) == ("fin.bank-statement", "scene")


def test_the_order_is_mention_then_pid_then_scene(roster):
    SceneBinding.objects.create(scene_id="month-end", agent_id="fin.bank-statement")
    assert resolve(mention="fin.tax", scene_id="month-end").agent_id == "fin.tax"
    assert resolve(mention="nobody", scene_id="month-end").agent_id == "fin.bank-statement"


def heartbeat(node: str, loads: dict[str, int]) -> None:
    env = protocol.new_envelope(
        message_type=protocol.MessageType.HEARTBEAT, from_agent_id=node,
        headers={"originNodeId": node},
        payload={"agents": [{"agentId": a, "inflight": n, "maxInflight": 10}
                            for a, n in loads.items()]},
    )
    messages_ingest(batch=[Incoming(protocol.heartbeat_topic("ooder", node),
                                    protocol.encode(env))], node_id="console", prefix="ooder")


def test_capability_routing_picks_the_least_loaded_live_agent():
    for agent_id, node in (("web.search-a", "node-a"), ("web.search-b", "node-b"),
                           ("web.search-c", "node-c")):
        register(agent_id, node, capabilities=["web_search"])
    heartbeat("node-a", {"web.search-a": 7})
    heartbeat("node-b", {"web.search-b": 2})
    heartbeat("node-c", {"web.search-c": 1})
    services.agent_drain(agent_id="web.search-c")
    r = route_capability(capability="web_search", from_agent_id="web.caller")
    assert (r.agent_id, r.node_id) == ("web.search-b", "node-b")
    why = {c.agent_id: c.why for c in r.candidates}
    assert why["web.search-c"].startswith("draining")
    # What the console has sent and not seen acknowledged counts as load too.
    r2 = route_capability(capability="web_search", from_agent_id="web.caller",
                          unacked=lambda ids: {"web.search-b": 6})
    assert r2.agent_id == "web.search-a"


def test_capability_routing_stays_in_the_namespace_unless_open():
    register("llm.search", "node-b", capabilities=["web_search"])
    r = route_capability(capability="web_search", from_agent_id="fin.caller")
    assert not r.ok and "no agent in namespace fin or an open namespace" in r.reason
    Namespace.objects.filter(name="llm").update(open_to_other_namespaces=True)
    assert route_capability(capability="web_search", from_agent_id="fin.caller").agent_id == (
        "llm.search")


def test_ties_in_routing_are_spread_round_robin():
    register("web.s1", "node-a", capabilities=["spread"])
    register("web.s2", "node-b", capabilities=["spread"])
    picks = {route_capability(capability="spread").agent_id for _ in range(4)}
    assert picks == {"web.s1", "web.s2"}


def test_a_region_breaks_a_tie():
    register("web.eu", "node-a", capabilities=["geo"], metadata={"region": "eu"})
    register("web.us", "node-b", capabilities=["geo"], metadata={"region": "us"})
    register("web.caller", "node-c", metadata={"region": "us"})
    for _ in range(3):
        assert route_capability(capability="geo", from_agent_id="web.caller").agent_id == "web.us"


def test_a_group_fans_out_one_row_per_routable_member(roster):
    register("fin.audit", "node-c", groups=["finance"])
    services.agent_drain(agent_id="fin.audit")
    members = group_members(group="#finance")
    assert {m.agent_id for m in members} == {"fin.tax", "ops.accountant", "fin.audit"}
    rows = messages_send_group(group="#finance", request=SendRequest(to="#finance",
                                                                     payload={"x": 1}))
    assert sorted(r.to_agent_id for r in rows) == ["fin.tax", "ops.accountant"]
    assert len({r.task_id for r in rows}) == 1
    assert len({r.idempotency_key for r in rows}) == 2  # each member executes its own copy
    assert all(r.status == Status.SENT for r in rows)


def test_a_send_across_namespaces_is_refused_unless_open(roster):
    with pytest.raises(SendRefused) as err:
        message_send(request=SendRequest(to="ops.accountant", from_agent_id="fin.tax"))
    assert err.value.code == "namespace_isolation"
    assert "namespace ops is not open" in err.value.detail
    assert not Message.objects.exists()
    Namespace.objects.filter(name="ops").update(open_to_other_namespaces=True)
    row = message_send(request=SendRequest(to="ops.accountant", from_agent_id="fin.tax"))
    assert row.status == Status.SENT


def test_the_send_records_level_and_candidates(roster):
    row = message_send(request=SendRequest(to="@资金日报", from_agent_id="fin.tax"))
    assert row.to_agent_id == "fin.bank-statement" and row.status == Status.SENT
    assert row.resolution["level"] == "mention" and row.resolution["match"] == "alias"
    assert row.resolution["candidates"][0]["chosen"] is True


def test_a_direct_send_records_its_one_candidate_as_chosen(roster, api):
    row = message_send(request=SendRequest(to="fin.tax", from_agent_id="fin.bank-statement"))
    assert row.status == Status.SENT and row.resolution["level"] == "roster"
    assert [(c["agentId"], c["chosen"]) for c in row.resolution["candidates"]] == [
        ("fin.tax", True)]
    sent = api.post("/api/a2a/send", {"to": "fin.tax"}).json()
    assert [c["chosen"] for c in sent["candidates"]] == [True]


def test_the_api_resolves_and_lists_specs(api, roster):
    r = api.get("/api/directory/resolve", {"mention": "@资金日报"})
    assert r.status_code == 200
    assert r.json()["agentId"] == "fin.bank-statement" and r.json()["level"] == "mention"
    miss = api.get("/api/directory/resolve", {"mention": "fin.tax", "targetNodeId": "node-b"})
    assert miss.status_code == 404
    assert miss.json()["candidates"][0]["agentId"] == "fin.tax"
    assert "never swapped" in miss.json()["detail"]
    entries = {e["capability"]: e for e in api.get("/api/directory/specs").json()}
    assert entries["tax"]["agentId"] == "fin.tax" and entries["tax"]["nodeId"] == "node-a"


def test_the_api_sends_to_a_capability_and_a_group(api, roster):
    r = api.post("/api/a2a/send", {"to": "capability:tax", "from": "fin.caller"})
    assert r.status_code == 202 and r.json()["toAgentId"] == "fin.tax"
    g = api.post("/api/a2a/send", {"to": "#finance", "payload": {}})
    assert g.status_code == 202 and g.json()["status"] == "FANNED_OUT"
    assert sorted(m["toAgentId"] for m in g.json()["messages"]) == ["fin.tax", "ops.accountant"]
    empty = api.post("/api/a2a/send", {"to": "#nobody"})
    assert empty.status_code == 200 and empty.json()["status"] == "UNDELIVERABLE"


def test_the_resolver_page_shows_every_candidate(admin_client, roster):
    services.agent_drain(agent_id="fin.tax")
    register("web.tax", "node-c", capabilities=["tax"])
    Alias.objects.filter(alias="tax").delete()
    html = admin_client.get("/directory/resolve/", {"mention": "tax"}).content.decode()
    assert 'data-candidate="web.tax"' in html and 'data-candidate="fin.tax"' in html
    assert "draining: it takes no new work" in html and "capability" in html
    names = admin_client.get("/directory/agents/fin.bank-statement/names/").content.decode()
    assert "@资金日报" in names


def test_the_agent_page_loads_its_names(admin_client, roster):
    page = admin_client.get("/agents/fin.bank-statement/").content.decode()
    assert 'hx-get="/directory/agents/fin.bank-statement/names/"' in page
    assert Agent.objects.get(agent_id="fin.bank-statement").segment == "bank-statement"
