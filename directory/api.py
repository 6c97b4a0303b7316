"""`/api/directory/resolve` and `/api/directory/specs`."""

from __future__ import annotations

from typing import Literal

from django.http import HttpRequest
from ninja import Query, Router, Schema, Status

from directory.resolver import NOT_DELIVERABLE, NOT_FOUND, resolve
from directory.specs import specs
from reachconsole.core.apidoc import refusals
from roster.models import Agent

router = Router(tags=["directory"])

# The fields keep the names of the JSON they describe (Candidate.as_dict, Resolution.as_dict,
# SpecEntry.as_dict): these schemas check those answers, they do not rename them.
CandidateStatus = Literal[(*Agent.Status.values, "STALE")]
Level = Literal["explicit", "mention", "pid", "scene", "roster", "local", "capability"]
Match = Literal["agent_id", "alias", "capability", "substring"]


class CandidateOut(Schema):
    agentId: str
    nodeId: str
    status: CandidateStatus
    routable: bool
    why: str
    namespace: str
    load: float
    chosen: bool


class ResolutionOut(Schema):
    agentId: str | None
    nodeId: str | None
    level: Level | None
    match: Match | None
    reason: str
    outcome: Literal[NOT_FOUND, NOT_DELIVERABLE] | None
    candidates: list[CandidateOut]


class ResolutionMissOut(ResolutionOut):
    """A miss: the resolution with the error shape's two fields beside it."""

    error: Literal[NOT_FOUND, NOT_DELIVERABLE]
    detail: str


class SpecOut(Schema):
    capability: str
    agentId: str
    nodeId: str
    namespace: str
    status: CandidateStatus
    routable: bool
    remote: bool
    shadowed: list[CandidateOut]


@router.get("/resolve", response={200: ResolutionOut, 404: ResolutionMissOut, **refusals()})
def resolve_view(
    request: HttpRequest,
    mention: str = Query("", max_length=200),
    target_node_id: str = Query("", alias="targetNodeId", max_length=128),
    pid: str = Query("", max_length=200),
    scene_id: str = Query("", alias="sceneId", max_length=200),
    namespace: str = Query("", max_length=64),
):
    """The agent and node for a mention, pid or scene, with every candidate considered; 404
    with the candidates and the reason on a miss."""
    result = resolve(mention=mention or None, target_node_id=target_node_id or None,
                     pid=pid or None, scene_id=scene_id or None, namespace=namespace or None,
                     namespaces=request.auth.token.namespaces)
    body = result.as_dict()
    if not result.ok:
        body["error"] = result.outcome or NOT_FOUND
        body["detail"] = result.reason
        return Status(404, body)
    return Status(200, body)


@router.get("/specs", response={200: list[SpecOut], **refusals()})
def specs_view(request: HttpRequest, namespace: str = Query("", max_length=64)):
    entries = specs(namespace=namespace or None, namespaces=request.auth.token.namespaces)
    return Status(200, [entry.as_dict() for entry in entries])
