"""One tenant per token: a token bound to namespaces sees and touches only their agents, an
owned agent answers only to its owner (or an operator), and the console's own agents are not
the API's to remove."""

from __future__ import annotations

import json

import pytest

from directory.models import Alias, SceneBinding
from messages.handlers import LOCAL_HANDLERS
from roster.models import Agent, Namespace
from tests.conftest import FIN_TOKEN, ApiClient, register

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]

REGISTER = {"agentId": "fin.tax", "nodeId": "node-a", "capabilities": ["tax"]}


@pytest.fixture
def tenants():
    """fin and llm (the bound token's namespaces) beside hr, which it must never see."""
    register("fin.tax", "node-a", capabilities=["tax"])
    register("llm.chat", "node-a", capabilities=["chat"])
    register("hr.tax", "node-a", capabilities=["tax"])
    register("hr.payroll", "node-h", capabilities=["payroll"])
    return ApiClient(token=FIN_TOKEN)


def _mentions_hr(body, asked: dict | None = None) -> bool:
    """Whether an answer names an hr agent or hr's node, beyond echoing what was asked."""
    text = json.dumps(body, ensure_ascii=False)
    for value in (asked or {}).values():
        text = text.replace(value, "")
    return "hr." in text or "node-h" in text


# --- a bound token sees only its namespaces -------------------------------------------------

def test_it_lists_only_the_tokens_namespaces_in_the_specs(tenants, api):
    entries = tenants.get("/api/directory/specs").json()
    assert sorted(e["agentId"] for e in entries) == ["fin.tax", "llm.chat"]
    assert not _mentions_hr(entries)  # nor among the shadowed candidates of `tax`
    everything = {e["capability"]: e for e in api.get("/api/directory/specs").json()}
    assert set(everything) == {"tax", "chat", "payroll"}
    tax = everything["tax"]
    assert {tax["agentId"], *(c["agentId"] for c in tax["shadowed"])} == {"fin.tax", "hr.tax"}


def test_it_never_resolves_a_bound_token_to_another_namespace(tenants):
    # hr.tax is the only live `tax`.
    Agent.objects.filter(agent_id="fin.tax").update(status=Agent.Status.DRAINING)
    r = tenants.get("/api/directory/resolve", {"mention": "tax"})
    assert r.status_code == 404
    assert [c["agentId"] for c in r.json()["candidates"]] == ["fin.tax"]
    assert not _mentions_hr(r.json())


@pytest.mark.parametrize("query", [
    {"mention": "hr.payroll"},          # an exact id
    {"mention": "payroll"},             # a capability segment
    {"mention": "payr"},                # a substring
    {"mention": "工资"},                  # an alias
    {"sceneId": "scene-payroll"},       # a scene binding
    {"mention": "payroll", "targetNodeId": "node-h"},
])
def test_it_does_not_leak_other_namespaces_in_a_miss(tenants, api, query):
    Alias.objects.create(alias="工资", agent_id="hr.payroll",
                         namespace=Namespace.objects.get(name="hr"))
    SceneBinding.objects.create(scene_id="scene-payroll", agent_id="hr.payroll")
    assert api.get("/api/directory/resolve", query).json()["agentId"] == "hr.payroll"
    r = tenants.get("/api/directory/resolve", query)
    assert r.status_code == 404, r.content
    assert r.json()["candidates"] == []
    assert not _mentions_hr(r.json(), query)


def test_it_still_resolves_within_the_tokens_namespaces(tenants):
    r = tenants.get("/api/directory/resolve", {"mention": "tax"})
    assert r.status_code == 200
    assert r.json()["agentId"] == "fin.tax"
    assert [c["agentId"] for c in r.json()["candidates"]] == ["fin.tax"]


def test_it_lists_only_nodes_hosting_the_tokens_agents(tenants, api):
    nodes = {n["nodeId"]: n for n in tenants.get("/api/cluster/nodes").json()}
    assert set(nodes) == {"node-a"}
    assert nodes["node-a"]["agents"] == 2  # fin.tax and llm.chat, not hr.tax
    everything = {n["nodeId"]: n["agents"] for n in api.get("/api/cluster/nodes").json()}
    assert everything == {"node-a": 3, "node-h": 1}


# --- an owned agent answers to its owner ----------------------------------------------------

def test_another_actor_cannot_take_over_an_owned_agent():
    alice, bob = ApiClient(actor="alice"), ApiClient(actor="bob")
    assert alice.post("/api/roster/agents", REGISTER).status_code == 201
    assert Agent.objects.get().owner == "alice"
    r = bob.post("/api/roster/agents", {**REGISTER, "version": "evil"})
    assert r.status_code == 403, r.content
    assert r.json()["error"] == "not_owner"
    assert "alice" in r.json()["detail"] and "bob" in r.json()["detail"]
    agent = Agent.objects.get()
    assert (agent.owner, agent.version) == ("alice", "")
    # The owner still can, and so can an operator (a token request without an actor).
    assert alice.post("/api/roster/agents", {**REGISTER, "version": "2"}).status_code == 200
    operator = ApiClient().post("/api/roster/agents", {**REGISTER, "version": "3"})
    assert operator.status_code == 200
    agent.refresh_from_db()
    assert (agent.owner, agent.version) == ("alice", "3")


@pytest.mark.parametrize("call", [
    lambda c: c.post("/api/roster/agents/fin.tax/heartbeat", {}),
    lambda c: c.post("/api/roster/agents/fin.tax/drain"),
    lambda c: c.delete("/api/roster/agents/fin.tax"),
    lambda c: c.post("/api/roster/agents", {**REGISTER, "owner": "bob"}),
])
def test_only_the_owner_renews_drains_or_deregisters(call):
    ApiClient(actor="alice").post("/api/roster/agents", REGISTER)
    r = call(ApiClient(actor="bob"))
    assert r.status_code == 403
    assert "alice" in r.json()["detail"]
    agent = Agent.objects.get()
    assert (agent.owner, agent.status) == ("alice", Agent.Status.ONLINE)


def test_a_first_claim_on_an_unowned_agent_is_kept():
    register("fin.tax", "node-a")
    r = ApiClient(actor="bob").post("/api/roster/agents", REGISTER)
    assert r.status_code == 200
    assert Agent.objects.get().owner == "bob"


# --- the console's own agents ---------------------------------------------------------------

def test_the_console_agents_are_the_local_handlers():
    from directory.resolver import LOCAL_AGENTS
    from roster.models import CONSOLE_AGENTS

    assert set(LOCAL_AGENTS) == set(CONSOLE_AGENTS)
    assert set(CONSOLE_AGENTS) == set(LOCAL_HANDLERS)


@pytest.mark.parametrize("call", [
    lambda c: c.delete("/api/roster/agents/ops.probe"),
    lambda c: c.post("/api/roster/agents/ops.probe/drain"),
    lambda c: c.post("/api/roster/agents/ops.probe/heartbeat", {}),
    lambda c: c.post("/api/roster/agents", {"agentId": "ops.probe", "nodeId": "node-x"}),
    lambda c: c.post("/api/roster/agents", {"agentId": "ops.probe", "nodeId": "console"}),
])
def test_the_api_cannot_remove_or_take_the_consoles_own_agents(settings, call):
    settings.REACH_NODE_ID = "console"
    register("ops.probe", "console", version="console", actor="bridge")
    r = call(ApiClient())
    assert r.status_code == 403, r.content
    assert r.json()["error"] == "console_agent"
    assert "console" in r.json()["detail"]
    agent = Agent.objects.get(agent_id="ops.probe")
    assert (agent.status, agent.node.node_id, agent.version) == (
        Agent.Status.ONLINE, "console", "console")


def test_no_agent_is_registered_on_the_consoles_node_over_the_api(settings):
    settings.REACH_NODE_ID = "console"
    r = ApiClient().post("/api/roster/agents", {**REGISTER, "nodeId": "console"})
    assert r.status_code == 403
    assert r.json()["error"] == "console_agent"
    assert not Agent.objects.exists()
    register("ops.notify", "console")  # e.g. left behind from before this rule
    assert ApiClient().delete("/api/roster/agents/ops.notify").status_code == 403
    assert Agent.objects.filter(agent_id="ops.notify").exists()
