"""`/api/directory/resolve` and `/api/directory/specs`."""

from __future__ import annotations

from django.http import HttpRequest
from ninja import Query, Router, Schema, Status

from directory.resolver import resolve
from directory.specs import specs

router = Router(tags=["directory"])


class ErrorOut(Schema):
    error: str
    detail: str


@router.get("/resolve", response={200: dict, 400: ErrorOut, 401: ErrorOut, 403: ErrorOut,
                                  404: dict, 422: ErrorOut})
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
                     pid=pid or None, scene_id=scene_id or None, namespace=namespace or None)
    body = result.as_dict()
    if not result.ok:
        body["error"] = result.outcome or "not_found"
        body["detail"] = result.reason
        return Status(404, body)
    return Status(200, body)


@router.get("/specs", response={200: list[dict], 401: ErrorOut, 403: ErrorOut})
def specs_view(request: HttpRequest, namespace: str = Query("", max_length=64)):
    return Status(200, [entry.as_dict() for entry in specs(namespace=namespace or None)])
