"""`/api/roster/…`, `/api/cluster/…` and `/api/ops/roster-consistency`: calls into services."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from ninja import Field, Query, Router, Schema, Status

from roster import errors, services
from roster.errors import AgentNotFound, NamespaceForbidden
from roster.models import Agent
from roster.reconcile import node_consistency, roster_consistency
from roster.selectors import AgentFilter, agents_filter, nodes_with_agents

router = Router(tags=["roster"])
cluster_router = Router(tags=["cluster"])
ops_router = Router(tags=["ops"])


class RegisterIn(Schema):
    agent_id: str = Field(..., alias="agentId", max_length=300)
    node_id: str = Field(..., alias="nodeId", max_length=200)
    version: str = Field("", max_length=64)
    capabilities: list[str] = Field(default_factory=list)
    groups: list[str] = Field(default_factory=list)
    endpoint: str = Field("", max_length=500)
    max_inflight: int | None = Field(None, alias="maxInflight")
    metadata: dict[str, Any] = Field(default_factory=dict)
    owner: str = Field("", max_length=128)


class HeartbeatIn(Schema):
    node_id: str | None = Field(None, alias="nodeId", max_length=200)
    inflight: int | None = Field(None, ge=0, le=10_000_000)
    queue_depth: int | None = Field(None, alias="queueDepth", ge=0, le=10_000_000)


class LeaseOut(Schema):
    agent_id: str = Field(..., serialization_alias="agentId")
    node_id: str = Field(..., serialization_alias="nodeId")
    status: str
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
    metadata: dict[str, Any]
    status: str
    stale: bool
    inflight: int
    queue_depth: int = Field(..., serialization_alias="queueDepth")
    lease_expires_at: datetime = Field(..., serialization_alias="leaseExpiresAt")
    last_heartbeat_at: datetime | None = Field(None, serialization_alias="lastHeartbeatAt")
    registered_at: datetime = Field(..., serialization_alias="registeredAt")
    drained_at: datetime | None = Field(None, serialization_alias="drainedAt")


class DeregisteredOut(Schema):
    agent_id: str = Field(..., serialization_alias="agentId")
    node_id: str = Field(..., serialization_alias="nodeId")
    deregistered: bool = True


class ErrorOut(Schema):
    error: str
    detail: str


class NodeOut(Schema):
    node_id: str = Field(..., serialization_alias="nodeId")
    url: str
    status: str
    last_seen: datetime | None = Field(None, serialization_alias="lastSeen")
    retired: bool
    consistency: str
    agents: int


class ConsistencyOut(Schema):
    agent_id: str = Field(..., serialization_alias="agentId")
    node_id: str = Field(..., serialization_alias="nodeId")
    agent_status: str = Field(..., serialization_alias="agentStatus")
    status: Literal["OK", "STALE", "UNKNOWN"]
    reason: str


ERRORS = {400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut,
          422: ErrorOut}


def _agent_out(agent: Agent, now: datetime) -> dict[str, Any]:
    return {
        "agent_id": agent.agent_id, "namespace": agent.namespace.name, "name": agent.name,
        "node_id": agent.node.node_id, "version": agent.version,
        "capabilities": agent.capabilities, "groups": agent.groups, "endpoint": agent.endpoint,
        "owner": agent.owner, "max_inflight": agent.max_inflight, "metadata": agent.metadata,
        "status": agent.status, "stale": agent.is_stale(now), "inflight": agent.inflight,
        "queue_depth": agent.queue_depth, "lease_expires_at": agent.lease_expires_at,
        "last_heartbeat_at": agent.last_heartbeat_at, "registered_at": agent.registered_at,
        "drained_at": agent.drained_at,
    }


def _lease_out(lease: services.Lease) -> dict[str, Any]:
    return {
        "agent_id": lease.agent.agent_id, "node_id": lease.agent.node.node_id,
        "status": lease.agent.status, "lease_ttl_ms": lease.lease_ttl_ms,
        "heartbeat_ms": lease.heartbeat_ms, "max_message_bytes": lease.max_message_bytes,
        "expires_at": lease.expires_at,
    }


def _existing_agent(request: HttpRequest, agent_id: str) -> Agent:
    """The agent named in the path, after the caller's namespace and actor are checked."""
    ref = services.agent_id_parse(agent_id)
    request.auth.require_namespace(ref.namespace)
    agent = Agent.objects.select_related("node", "namespace").filter(agent_id=ref.agent_id).first()
    if agent is None:
        raise AgentNotFound(errors.AGENT_NOT_FOUND.format(agent_id=ref.agent_id))
    request.auth.require_owner(agent.owner)
    return agent


@router.post("/agents", response={200: LeaseOut, 201: LeaseOut, **ERRORS}, by_alias=True)
def register(request: HttpRequest, body: RegisterIn):
    ref = services.agent_id_parse(body.agent_id)
    request.auth.require_namespace(ref.namespace)
    request.auth.require_owner(body.owner)
    lease = services.agent_register(
        agent_id=body.agent_id, node_id=body.node_id, version=body.version,
        capabilities=body.capabilities, groups=body.groups, endpoint=body.endpoint,
        max_inflight=body.max_inflight, metadata=body.metadata,
        owner=body.owner or request.auth.actor, actor=request.auth.label,
    )
    return Status((201 if lease.created else 200), _lease_out(lease))


@router.get("/agents", response={200: list[AgentOut], **ERRORS}, by_alias=True)
def agents_list(
    request: HttpRequest,
    response: HttpResponse,
    namespace: str = "",
    node_id: str = Query("", alias="nodeId"),
    capability: str = "",
    status: Literal["", "ONLINE", "DRAINING", "OFFLINE", "STALE"] = "",
    stale: bool | None = None,
    limit: int = Query(1000, ge=1, le=10000),
    offset: int = Query(0, ge=0, le=100_000_000),
):
    qs = agents_filter(
        AgentFilter(namespace=namespace, node_id=node_id, capability=capability, status=status,
                    stale=stale)
    )
    namespaces = request.auth.token.namespaces
    if namespaces is not None:
        qs = qs.filter(namespace__name__in=namespaces)
    response["X-Total-Count"] = str(qs.count())
    now = timezone.now()
    return Status(200, [_agent_out(agent, now) for agent in qs[offset : offset + limit]])


@router.get("/agents/{agent_id}", response={200: AgentOut, **ERRORS}, by_alias=True)
def agent_detail(request: HttpRequest, agent_id: str):
    return Status(200, _agent_out(_existing_agent(request, agent_id), timezone.now()))


@router.post("/agents/{agent_id}/heartbeat", response={200: LeaseOut, **ERRORS}, by_alias=True)
def heartbeat(request: HttpRequest, agent_id: str, body: HeartbeatIn | None = None):
    agent = _existing_agent(request, agent_id)
    body = body or HeartbeatIn()
    lease = services.agent_renew(
        agent_id=agent.agent_id, node_id=body.node_id, inflight=body.inflight,
        queue_depth=body.queue_depth,
    )
    return Status(200, _lease_out(lease))


@router.post("/agents/{agent_id}/drain", response={200: AgentOut, **ERRORS}, by_alias=True)
def drain(request: HttpRequest, agent_id: str):
    agent = _existing_agent(request, agent_id)
    agent = services.agent_drain(agent_id=agent.agent_id, actor=request.auth.label)
    agent.refresh_from_db()
    return Status(200, _agent_out(agent, timezone.now()))


@router.delete("/agents/{agent_id}", response={200: DeregisteredOut, **ERRORS}, by_alias=True)
def deregister(request: HttpRequest, agent_id: str):
    agent = _existing_agent(request, agent_id)
    node_id = services.agent_deregister(agent_id=agent.agent_id, actor=request.auth.label)
    return Status(200, {"agent_id": agent.agent_id, "node_id": node_id})


@cluster_router.get("/nodes", response={200: list[NodeOut], **ERRORS}, by_alias=True)
def nodes(request: HttpRequest):
    now = timezone.now()
    rows = []
    for node in nodes_with_agents():
        consistency, _ = node_consistency(node, now=now)
        rows.append({
            "node_id": node.node_id, "url": node.url,
            "status": "RETIRED" if node.retired else node.status, "last_seen": node.last_seen_at,
            "retired": node.retired, "consistency": consistency.value,
            "agents": node.agent_count,
        })
    return Status(200, rows)


@ops_router.get("/roster-consistency", response={200: list[ConsistencyOut], **ERRORS},
                by_alias=True)
def consistency(request: HttpRequest):
    if request.auth.token.namespaces is not None:
        raise NamespaceForbidden(errors.CONSISTENCY_NEEDS_ALL_NAMESPACES)
    return Status(200, [
        {"agent_id": row.agent_id, "node_id": row.node_id, "agent_status": row.agent_status,
         "status": row.consistency.value, "reason": row.reason}
        for row in roster_consistency()
    ])
