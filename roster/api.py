"""`/api/roster/…`, `/api/cluster/…` and `/api/ops/roster-consistency`: calls into services."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from ninja import Field, Query, Router, Schema, Status
from pydantic import model_validator

from reachconsole.core.apidoc import BodyIn, JsonObject, json_int, refusals
from roster import errors, ids, services
from roster.errors import AgentNotFound, ConsoleAgent, NamespaceForbidden, NoLease, NotOwner
from roster.fields import (
    AgentIdInput,
    Capabilities,
    Groups,
    MaxInflight,
    NodeId,
    RosterAgentId,
)
from roster.hearing import bus_hearing
from roster.models import (
    CONSOLE_AGENTS,
    Agent,
    ClusterNode,
    Consistency,
    Dialect,
    is_console_agent,
)
from roster.reconcile import roster_consistency
from roster.selectors import AgentFilter, agents_filter, nodes_with_agents

router = Router(tags=["roster"])
cluster_router = Router(tags=["cluster"])
ops_router = Router(tags=["ops"])


# The reachability layer's identity object spells the body in snake_case and keeps the
# namespace apart (`{"namespace": "fin", "agent_id": "tax", ...}`); it is accepted as
# another spelling of this body (docs/protocol.md, "Register").
_SNAKE_CASE = {"agent_id": "agentId", "node_id": "nodeId", "max_inflight": "maxInflight"}


def identity_object_normalize(data: Any) -> Any:
    """`data` with the identity object's spellings turned into the body's own: snake_case keys
    into camelCase, and a separate `namespace` folded into the agent id. A key sent in both
    spellings with different values, or a namespace the agent id contradicts, is refused."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for snake, camel in _SNAKE_CASE.items():
        if snake not in data:
            continue
        value = data.pop(snake)
        if camel in data and data[camel] != value:
            raise ValueError(f"{camel} and {snake} name the same field with different values: "
                             "send one of them")
        data[camel] = value
    namespace = data.pop("namespace", None)
    agent_id = data.get("agentId")
    if namespace is None or not isinstance(agent_id, str):
        return data
    if not isinstance(namespace, str) or not namespace:
        raise ValueError("namespace must be a non-empty string (or leave it out and send "
                         "agentId as `namespace.name`)")
    own, _ = ids.agent_id_split(agent_id.strip())
    if not own:
        data["agentId"] = f"{namespace}.{agent_id}"
    elif own != namespace:
        raise ValueError(f"namespace {namespace!r} contradicts the agent id {agent_id!r}, whose "
                         f"namespace is {own!r}: send one of them")
    return data


class RegisterIn(BodyIn):
    """camelCase as below, or the identity object (`namespace`, `agent_id`, `node_id`,
    `max_inflight`, snake_case), normalized to it."""

    @model_validator(mode="before")
    @classmethod
    def _identity_object(cls, data: Any) -> Any:
        return identity_object_normalize(data)

    agent_id: AgentIdInput = Field(..., alias="agentId")
    node_id: NodeId = Field(..., alias="nodeId")
    version: str = Field("", max_length=64)
    capabilities: Capabilities = Field(
        default_factory=list, description="empty: the last segment of the agent's name")
    groups: Groups = Field(default_factory=list, description="`#data-processing` or without #")
    endpoint: str = Field("", max_length=500)
    max_inflight: MaxInflight | None = Field(
        None, alias="maxInflight", description="unacknowledged messages it takes at once")
    metadata: JsonObject = Field(
        default_factory=dict, description="at most REACH_MAX_METADATA_BYTES as JSON (422)")
    owner: str = Field("", max_length=128)


class HeartbeatIn(BodyIn):
    node_id: NodeId | None = Field(None, alias="nodeId")
    inflight: json_int(ge=0, le=10_000_000) | None = None
    queue_depth: json_int(ge=0, le=10_000_000) | None = Field(None, alias="queueDepth")


# The values each status field can take, from the models that own them.
AgentStatus = Literal[tuple(Agent.Status.values)]
NodeStatus = Literal[(*ClusterNode.Status.values, "RETIRED")]
ConsistencyStatus = Literal[tuple(Consistency.values)]


class LeaseOut(Schema):
    agent_id: str = Field(..., serialization_alias="agentId")
    node_id: str = Field(..., serialization_alias="nodeId")
    status: AgentStatus
    lease_ttl_ms: int = Field(..., serialization_alias="leaseTtlMs")
    heartbeat_ms: int = Field(..., serialization_alias="heartbeatMs")
    max_message_bytes: int = Field(..., serialization_alias="maxMessageBytes")
    expires_at: datetime = Field(..., serialization_alias="expiresAt")


class AgentOut(Schema):
    agent_id: str = Field(..., serialization_alias="agentId")
    namespace: str
    name: str
    node_id: str = Field(..., serialization_alias="nodeId")
    version: str
    capabilities: list[str]
    groups: list[str]
    endpoint: str
    owner: str
    max_inflight: int = Field(..., serialization_alias="maxInflight")
    metadata: JsonObject
    status: AgentStatus
    stale: bool
    inflight: int
    queue_depth: int = Field(..., serialization_alias="queueDepth")
    lease_expires_at: datetime = Field(..., serialization_alias="leaseExpiresAt")
    last_heartbeat_at: datetime | None = Field(None, serialization_alias="lastHeartbeatAt")
    registered_at: datetime = Field(..., serialization_alias="registeredAt")
    drained_at: datetime | None = Field(None, serialization_alias="drainedAt")
    dialect: Literal["native", "a2a-mqtt"] = Field(
        "native", description="native: the envelope on a node's inbox, with a lease; "
        "a2a-mqtt: an A2A-over-MQTT profile agent, registered by its retained Agent Card")
    presence_source: str = Field("", serialization_alias="presenceSource", description=(
        "a2a-mqtt only: who said its status last (agent, lwt: its Last Will, broker)"))
    presence_since: datetime | None = Field(None, serialization_alias="presenceSince")


class DeregisteredOut(Schema):
    agent_id: str = Field(..., serialization_alias="agentId")
    node_id: str = Field(..., serialization_alias="nodeId")
    deregistered: bool = True


class NodeOut(Schema):
    node_id: str = Field(..., serialization_alias="nodeId")
    url: str
    status: NodeStatus
    last_seen: datetime | None = Field(None, serialization_alias="lastSeen")
    retired: bool
    consistency: ConsistencyStatus
    agents: int


class ConsistencyOut(Schema):
    agent_id: str = Field(..., serialization_alias="agentId")
    node_id: str = Field(..., serialization_alias="nodeId")
    agent_status: AgentStatus = Field(..., serialization_alias="agentStatus")
    status: ConsistencyStatus
    reason: str




def _agent_out(agent: Agent, now: datetime) -> dict[str, Any]:
    return {
        "agent_id": agent.agent_id, "namespace": agent.namespace.name, "name": agent.name,
        "node_id": agent.node.node_id, "version": agent.version,
        "capabilities": agent.capabilities, "groups": agent.groups, "endpoint": agent.endpoint,
        "owner": agent.owner, "max_inflight": agent.max_inflight, "metadata": agent.metadata,
        "status": agent.status, "stale": agent.is_stale(hearing=bus_hearing(now=now)),
        "inflight": agent.inflight,
        "queue_depth": agent.queue_depth, "lease_expires_at": agent.lease_expires_at,
        "last_heartbeat_at": agent.last_heartbeat_at, "registered_at": agent.registered_at,
        "drained_at": agent.drained_at, "dialect": agent.dialect,
        "presence_source": agent.presence_source, "presence_since": agent.presence_since,
    }


def _lease_out(lease: services.Lease) -> dict[str, Any]:
    return {
        "agent_id": lease.agent.agent_id, "node_id": lease.agent.node.node_id,
        "status": lease.agent.status, "lease_ttl_ms": lease.lease_ttl_ms,
        "heartbeat_ms": lease.heartbeat_ms, "max_message_bytes": lease.max_message_bytes,
        "expires_at": lease.expires_at,
    }


def _existing_agent(request: HttpRequest, agent_id: str, *, action: str = "") -> Agent:
    """The agent named in the path, after the caller's namespace and actor are checked; with
    an `action` (a change), also that it is not one of the console's own agents."""
    stored = ids.stored_agent_id(agent_id)  # `fin/tax` → `fin.tax`; a profile id as it is
    request.auth.require_namespace(ids.agent_namespace(agent_id))
    agent = Agent.objects.select_related("node", "namespace").filter(agent_id=stored).first()
    if agent is None:
        raise AgentNotFound(errors.AGENT_NOT_FOUND.format(agent_id=stored))
    actor = request.auth.actor
    if action and actor and agent.owner and agent.owner != actor:
        raise NotOwner(errors.NOT_OWNER.format(agent_id=agent.agent_id, owner=agent.owner,
                                               actor=actor, action=action))
    request.auth.require_owner(agent.owner)
    if action and is_console_agent(agent.agent_id, agent.node.node_id):
        raise ConsoleAgent(errors.CONSOLE_AGENT.format(agent_id=agent.agent_id,
                                                       node_id=agent.node.node_id))
    return agent


# The registered agent, as the answer names it (`fin/tax` comes back as `fin.tax`), is what
# the operations on one agent take: OpenAPI links say so to clients and to fuzzers.
_AGENT_LINKS = {
    "links": {
        name: {"operationId": f"roster_api_{name}",
               "parameters": {"agent_id": "$response.body#/agentId"}}
        for name in ("agent_detail", "heartbeat", "drain", "undrain", "deregister")
    },
}


@router.post("/agents", response={200: LeaseOut, 201: LeaseOut, **refusals(409, body=True)},
             by_alias=True,
             openapi_extra={"responses": {200: _AGENT_LINKS, 201: _AGENT_LINKS}})
def register(request: HttpRequest, body: RegisterIn):
    ref = ids.agent_id_parse(body.agent_id)
    request.auth.require_namespace(ref.namespace)
    request.auth.require_owner(body.owner)
    if ref.agent_id in CONSOLE_AGENTS:
        raise ConsoleAgent(errors.CONSOLE_AGENT.format(agent_id=ref.agent_id,
                                                       node_id=settings.REACH_NODE_ID))
    if is_console_agent(ref.agent_id, body.node_id):
        raise ConsoleAgent(errors.CONSOLE_NODE.format(node_id=body.node_id))
    lease = services.agent_register(
        agent_id=body.agent_id, node_id=body.node_id, version=body.version,
        capabilities=body.capabilities, groups=body.groups, endpoint=body.endpoint,
        max_inflight=body.max_inflight, metadata=body.metadata,
        owner=body.owner or request.auth.actor, actor=request.auth.label,
        acting_for=request.auth.actor,
    )
    return Status((201 if lease.created else 200), _lease_out(lease))


@router.get("/agents", response={200: list[AgentOut], **refusals()}, by_alias=True)
def agents_list(
    request: HttpRequest,
    response: HttpResponse,
    namespace: str = Query("", max_length=64),
    node_id: str = Query("", alias="nodeId", max_length=128),
    capability: str = Query("", max_length=600),
    status: Literal["", "ONLINE", "DRAINING", "OFFLINE", "STALE"] = "",
    stale: bool | None = None,
    dialect: Literal["", "native", "a2a-mqtt"] = "",
    limit: int = Query(1000, ge=1, le=10000),
    offset: int = Query(0, ge=0, le=100_000_000),
    after: str = Query("", max_length=265, description=(
        "keyset paging: the agent id after which this page starts, as given in the "
        "`X-Next-Cursor` header (and `Link: rel=next`) of the previous page")),
):
    """The roster by agent id. Page with `after` (each page costs the same, however deep);
    `offset` still works but reads every row it skips."""
    qs = agents_filter(
        AgentFilter(namespace=namespace, node_id=node_id, capability=capability, status=status,
                    stale=stale, dialect=dialect)
    )
    namespaces = request.auth.token.namespaces
    if namespaces is not None:
        qs = qs.filter(namespace__name__in=namespaces)
    response["X-Total-Count"] = str(qs.count())
    if after:
        qs = qs.filter(agent_id__gt=after)
    now = timezone.now()
    page = list(qs[offset : offset + limit + 1])
    if len(page) > limit:
        page = page[:limit]
        cursor = page[-1].agent_id
        response["X-Next-Cursor"] = cursor
        query = request.GET.copy()
        query["after"] = cursor
        query.pop("offset", None)
        response["Link"] = f'<{request.path}?{query.urlencode()}>; rel="next"'
    return Status(200, [_agent_out(agent, now) for agent in page])


# `{agent:agent_id}`: a profile agent's id has slashes (roster/converters.py). The same path
# for the GET and the DELETE: Django stops at the first address that matches.
@router.get("/agents/{agent:agent_id}", response={200: AgentOut, **refusals(404)},
            by_alias=True)
def agent_detail(request: HttpRequest, agent_id: RosterAgentId):
    return Status(200, _agent_out(_existing_agent(request, agent_id), timezone.now()))


@router.post("/agents/{agent:agent_id}/heartbeat",
             response={200: LeaseOut, **refusals(404, 409, body=True)}, by_alias=True)
def heartbeat(request: HttpRequest, agent_id: RosterAgentId, body: HeartbeatIn | None = None):
    agent = _existing_agent(request, agent_id, action="renew")
    if agent.dialect != Dialect.NATIVE:
        raise NoLease(errors.PROFILE_NO_LEASE.format(agent_id=agent.agent_id))
    body = body or HeartbeatIn()
    lease = services.agent_renew(
        agent_id=agent.agent_id, node_id=body.node_id, inflight=body.inflight,
        queue_depth=body.queue_depth,
    )
    return Status(200, _lease_out(lease))


@router.post("/agents/{agent:agent_id}/drain", response={200: AgentOut, **refusals(404)},
             by_alias=True)
def drain(request: HttpRequest, agent_id: RosterAgentId):
    agent = _existing_agent(request, agent_id, action="drain")
    agent = services.agent_drain(agent_id=agent.agent_id, actor=request.auth.label)
    agent.refresh_from_db()
    return Status(200, _agent_out(agent, timezone.now()))


@router.post("/agents/{agent:agent_id}/undrain",
             response={200: AgentOut, **refusals(404, 409)}, by_alias=True)
def undrain(request: HttpRequest, agent_id: RosterAgentId):
    """Undo a drain: the agent takes new work again. 404 once it left the roster, 409 when
    its lease lapsed while draining (it is leaving)."""
    agent = _existing_agent(request, agent_id, action="undrain")
    agent = services.agent_undrain(agent_id=agent.agent_id, actor=request.auth.label)
    agent.refresh_from_db()
    return Status(200, _agent_out(agent, timezone.now()))


@router.delete("/agents/{agent:agent_id}", response={200: DeregisteredOut, **refusals(404)},
               by_alias=True)
def deregister(request: HttpRequest, agent_id: RosterAgentId):
    agent = _existing_agent(request, agent_id, action="deregister")
    node_id = services.agent_deregister(agent_id=agent.agent_id, actor=request.auth.label)
    return Status(200, {"agent_id": agent.agent_id, "node_id": node_id})


@cluster_router.get("/nodes", response={200: list[NodeOut], **refusals()}, by_alias=True)
def nodes(request: HttpRequest):
    rows = []
    for node in nodes_with_agents(namespaces=request.auth.token.namespaces):
        rows.append({
            "node_id": node.node_id, "url": node.url,
            "status": "RETIRED" if node.retired else node.status, "last_seen": node.last_seen_at,
            "retired": node.retired, "consistency": node.consistency,
            "agents": node.agent_count,
        })
    return Status(200, rows)


@ops_router.get("/roster-consistency", response={200: list[ConsistencyOut], **refusals()},
                by_alias=True)
def consistency(request: HttpRequest):
    if request.auth.token.namespaces is not None:
        raise NamespaceForbidden(errors.CONSISTENCY_NEEDS_ALL_NAMESPACES)
    return Status(200, [
        {"agent_id": row.agent_id, "node_id": row.node_id, "agent_status": row.agent_status,
         "status": row.consistency, "reason": row.reason}
        for row in roster_consistency()
    ])
