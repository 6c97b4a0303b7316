from __future__ import annotations

import pytest

from reachconsole.core.audit import AuditEntry
from roster import services
from roster.models import Agent, ClusterNode, RosterEvent
from tests.conftest import FIN_TOKEN, ROTATED_TOKEN, ApiClient, bridge_hears, register

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]

REGISTER = {
    "agentId": "fin.tax", "nodeId": "node-a", "version": "1.2", "capabilities": ["tax"],
    "groups": ["#finance"], "endpoint": "http://node-a:8080", "maxInflight": 4,
    "metadata": {"region": "eu"},
}


def test_it_registers_and_returns_the_lease(api, settings):
    r = api.post("/api/roster/agents", REGISTER)
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["agentId"] == "fin.tax" and body["nodeId"] == "node-a"
    assert body["leaseTtlMs"] == settings.REACH_LEASE_TTL_MS
    assert body["heartbeatMs"] == settings.REACH_HEARTBEAT_MS
    assert body["maxMessageBytes"] == settings.REACH_MAX_MESSAGE_BYTES
    assert body["expiresAt"].startswith(str(Agent.objects.get().lease_expires_at.year))
    again = api.post("/api/roster/agents", REGISTER)
    assert again.status_code == 200
    assert Agent.objects.count() == 1


def test_it_normalizes_slash_ids(api):
    r = api.post("/api/roster/agents", {**REGISTER, "agentId": "fin/tax"})
    assert r.status_code == 201
    assert r.json()["agentId"] == "fin.tax"


def test_it_answers_409_naming_the_holder(api):
    api.post("/api/roster/agents", REGISTER)
    r = api.post("/api/roster/agents", {**REGISTER, "nodeId": "node-b"})
    assert r.status_code == 409
    assert r.json()["error"] == "agent_held_elsewhere"
    assert "node-a" in r.json()["detail"]


# --- the auth matrix --------------------------------------------------------------------------

def test_it_refuses_a_missing_token(api):
    r = ApiClient().client.post("/api/roster/agents", REGISTER, content_type="application/json",
                                headers={"X-OODER-Source": "studio"})
    assert r.status_code == 401
    assert r.json()["error"] == "unauthorized"
    assert "Authorization: Bearer" in r.json()["detail"]
    assert not Agent.objects.exists()


def test_it_refuses_a_wrong_token():
    r = ApiClient(token="not-a-real-token-xxxxxx").post("/api/roster/agents", REGISTER)
    assert r.status_code == 401
    assert "not valid" in r.json()["detail"]
    assert not Agent.objects.exists()


def test_it_accepts_every_token_of_a_rotation():
    r = ApiClient(token=ROTATED_TOKEN).post("/api/roster/agents", REGISTER)
    assert r.status_code == 201


def test_it_refuses_an_untrusted_source():
    r = ApiClient(source="somewhere-else").post("/api/roster/agents", REGISTER)
    assert r.status_code == 403
    assert r.json()["error"] == "untrusted_source"
    assert "studio" in r.json()["detail"]
    assert not Agent.objects.exists()


def test_it_refuses_an_actor_who_is_not_the_owner():
    r = ApiClient(actor="mallory").post("/api/roster/agents", {**REGISTER, "owner": "alice"})
    assert r.status_code == 403
    assert r.json()["error"] == "actor_mismatch"
    assert not Agent.objects.exists()
    ok = ApiClient(actor="alice").post("/api/roster/agents", {**REGISTER, "owner": "alice"})
    assert ok.status_code == 201
    drain = ApiClient(actor="mallory").post("/api/roster/agents/fin.tax/drain")
    assert drain.status_code == 403
    assert Agent.objects.get().status == Agent.Status.ONLINE


def test_it_binds_a_token_to_its_namespaces():
    fin = ApiClient(token=FIN_TOKEN)
    assert fin.post("/api/roster/agents", REGISTER).status_code == 201
    r = fin.post("/api/roster/agents", {**REGISTER, "agentId": "ops.probe"})
    assert r.status_code == 403
    assert r.json()["error"] == "namespace_forbidden"
    register("ops.other")
    assert fin.post("/api/roster/agents/ops.other/drain").status_code == 403
    assert fin.delete("/api/roster/agents/ops.other").status_code == 403
    assert Agent.objects.get(agent_id="ops.other").status == Agent.Status.ONLINE
    listed = [a["agentId"] for a in fin.get("/api/roster/agents").json()]
    assert listed == ["fin.tax"]


# --- bad input: 4xx with words, nothing written ------------------------------------------------

def test_it_answers_400_to_bad_json(api):
    r = api.post("/api/roster/agents", raw="{not json")
    assert r.status_code == 400
    assert r.json()["error"] == "bad_json"
    assert not Agent.objects.exists()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"nodeId": "node-a"}, "agentId"),
        ({"agentId": "fin.tax"}, "nodeId"),
        ({**REGISTER, "capabilities": "tax"}, "capabilities"),
        ({**REGISTER, "maxInflight": "lots"}, "maxInflight"),
        ([1, 2, 3], "body"),
    ],
)
def test_it_answers_422_to_missing_or_mistyped_fields(api, body, words):
    r = api.post("/api/roster/agents", body)
    assert r.status_code == 422, r.content
    assert r.json()["error"] == "invalid_request"
    assert words in r.json()["detail"]
    assert not Agent.objects.exists() and not ClusterNode.objects.exists()


@pytest.mark.parametrize(
    ("patch", "code"),
    [
        ({"agentId": "no-namespace"}, "invalid_agent_id"),
        ({"nodeId": "node/#"}, "invalid_field"),
        ({"metadata": {"blob": "x" * 40000}}, "invalid_field"),
        ({"maxInflight": 0}, "invalid_field"),
        ({"capabilities": ["ok", "not ok"]}, "invalid_field"),
    ],
)
def test_it_answers_422_to_values_the_roster_refuses(api, patch, code):
    r = api.post("/api/roster/agents", {**REGISTER, **patch})
    assert r.status_code == 422, r.content
    assert r.json()["error"] == code
    assert len(r.json()["detail"]) > 20
    assert not Agent.objects.exists() and not ClusterNode.objects.exists()


def test_it_renews_drains_and_deregisters(api):
    api.post("/api/roster/agents", REGISTER)
    hb = api.post("/api/roster/agents/fin.tax/heartbeat", {"nodeId": "node-a", "inflight": 2})
    assert hb.status_code == 200 and hb.json()["status"] == "ONLINE"
    assert Agent.objects.get().inflight == 2
    wrong = api.post("/api/roster/agents/fin.tax/heartbeat", {"nodeId": "node-z"})
    assert wrong.status_code == 409 and wrong.json()["error"] == "wrong_node"
    drained = api.post("/api/roster/agents/fin.tax/drain")
    assert drained.status_code == 200 and drained.json()["status"] == "DRAINING"
    gone = api.delete("/api/roster/agents/fin.tax")
    assert gone.status_code == 200 and gone.json() == {
        "agentId": "fin.tax", "nodeId": "node-a", "deregistered": True}
    assert not Agent.objects.exists()
    assert RosterEvent.objects.filter(kind="DEREGISTERED", actor__startswith="studio:").exists()
    audited = AuditEntry.objects.order_by("id")
    assert [(row.action, row.target, row.result, row.detail) for row in audited] == [
        ("drain", "fin.tax", "ok", ""), ("deregister", "fin.tax", "ok", "from node-a")]
    assert all(row.actor.startswith("studio:") for row in audited)
    assert api.post("/api/roster/agents/fin.tax/heartbeat").status_code == 404
    assert api.delete("/api/roster/agents/fin.tax").json()["error"] == "agent_not_found"


def test_it_filters_the_roster(api, now):
    register("fin.tax", "node-a", capabilities=["tax", "vat"])
    register("fin.vat", "node-b", capabilities=["vat-report"])
    register("llm.chat", "node-b", capabilities=["chat"])
    services.agent_drain(agent_id="llm.chat")

    def ids(**params):
        r = api.get("/api/roster/agents", params)
        assert r.status_code == 200, r.content
        return [a["agentId"] for a in r.json()]

    assert ids() == ["fin.tax", "fin.vat", "llm.chat"]
    assert ids(namespace="fin") == ["fin.tax", "fin.vat"]
    assert ids(nodeId="node-b") == ["fin.vat", "llm.chat"]
    assert ids(capability="vat") == ["fin.tax"]  # a whole capability, not a prefix
    assert ids(status="DRAINING") == ["llm.chat"]
    assert ids(stale="false") == ["fin.tax", "fin.vat", "llm.chat"]
    assert ids(stale="true") == []
    assert api.get("/api/roster/agents", {"status": "BOGUS"}).status_code == 422


def test_agents_on_a_stale_node_are_stale_in_every_filter_and_field(api, now):
    """`?stale=true` answered [] while an agent's node was STALE, although the directory
    calls such an agent STALE and routes nothing to it."""
    from roster.models import Consistency

    register("fin.tax", "node-a")
    register("fin.vat", "node-b")
    services.node_seen(node_id="node-a")
    services.node_seen(node_id="node-b")
    ClusterNode.objects.filter(node_id="node-b").update(
        consistency=Consistency.STALE, consistency_reason="node node-b is not in the set")
    stale = api.get("/api/roster/agents", {"stale": "true"}).json()
    assert [a["agentId"] for a in stale] == ["fin.vat"] and stale[0]["stale"] is True
    assert [a["agentId"] for a in api.get("/api/roster/agents", {"status": "STALE"}).json()
            ] == ["fin.vat"]
    fresh = api.get("/api/roster/agents", {"stale": "false"}).json()
    assert [(a["agentId"], a["stale"]) for a in fresh] == [("fin.tax", False)]


def test_a_node_never_heard_is_registered_not_online(api, now):
    """`/api/cluster/nodes` showed a node ONLINE with `lastSeen: null`."""
    register("fin.tax", "node-a")
    node = {n["nodeId"]: n for n in api.get("/api/cluster/nodes").json()}["node-a"]
    assert (node["status"], node["lastSeen"]) == ("REGISTERED", None)
    services.node_seen(node_id="node-a")
    node = {n["nodeId"]: n for n in api.get("/api/cluster/nodes").json()}["node-a"]
    assert node["status"] == "ONLINE" and node["lastSeen"]


def test_it_lists_nodes_and_consistency(api, now):
    register("fin.tax", "node-a")
    register("fin.vat", "node-b")
    register("fin.gone", "node-c")
    services.node_seen(node_id="node-a")
    services.node_seen(node_id="node-c")
    services.node_retire(node_id="node-c")
    nodes = {n["nodeId"]: n for n in api.get("/api/cluster/nodes").json()}
    assert set(nodes) == {"node-a", "node-b", "node-c"}
    assert nodes["node-a"]["status"] == "ONLINE" and nodes["node-a"]["lastSeen"]
    assert nodes["node-b"]["lastSeen"] is None
    assert nodes["node-c"]["status"] == "RETIRED" and nodes["node-a"]["agents"] == 1
    rows = {r["agentId"]: r["status"] for r in api.get("/api/ops/roster-consistency").json()}
    assert rows == {"fin.tax": "OK", "fin.vat": "UNKNOWN", "fin.gone": "STALE"}
    assert ApiClient(token=FIN_TOKEN).get("/api/ops/roster-consistency").status_code == 403


def test_it_serves_the_openapi_document(api):
    r = api.client.get("/api/openapi.json")
    assert r.status_code == 200
    paths = r.json()["paths"]
    assert "/api/roster/agents" in paths and "/api/cluster/nodes" in paths


def test_it_reports_health_and_readiness(client):
    bridge_hears("reach-console-1")
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"]["database"]["ok"] is True


# --- the reachability layer's identity object ---------------------------------------------------

IDENTITY = {
    "namespace": "fin", "agent_id": "tax", "node_id": "node-a", "version": "1.2",
    "capabilities": ["tax"], "endpoint": "http://node-a:8080", "max_inflight": 4,
    "metadata": {"region": "eu"},
}


def test_the_identity_object_registers_as_the_camel_case_body_does(api):
    r = api.post("/api/roster/agents", IDENTITY)
    assert r.status_code == 201, r.content
    assert r.json()["agentId"] == "fin.tax" and r.json()["nodeId"] == "node-a"
    agent = Agent.objects.get()
    assert (agent.agent_id, agent.namespace.name, agent.name) == ("fin.tax", "fin", "tax")
    assert (agent.max_inflight, agent.version, agent.metadata) == (4, "1.2", {"region": "eu"})
    # The same agent in the other spelling is a renewal of one registration, not a second.
    again = api.post("/api/roster/agents", REGISTER)
    assert again.status_code == 200 and Agent.objects.count() == 1


def test_the_identity_object_may_carry_the_whole_agent_id(api):
    r = api.post("/api/roster/agents", {**IDENTITY, "agent_id": "fin.tax"})
    assert r.status_code == 201, r.content
    assert Agent.objects.get().agent_id == "fin.tax"


@pytest.mark.parametrize("body, words", [
    ({**IDENTITY, "agent_id": "hr.tax"}, "namespace 'fin' contradicts the agent id 'hr.tax'"),
    ({**IDENTITY, "agentId": "fin.audit"}, "agentId and agent_id name the same field"),
    ({**IDENTITY, "namespace": ""}, "namespace must be a non-empty string"),
    ({k: v for k, v in IDENTITY.items() if k != "node_id"}, "nodeId: Field required"),
])
def test_an_identity_object_that_contradicts_itself_is_refused_with_words(api, body, words):
    r = api.post("/api/roster/agents", body)
    assert r.status_code == 422, r.content
    assert r.json()["error"] == "invalid_request"
    assert words in r.json()["detail"]
    assert not Agent.objects.exists()
