"""`/api/a2a/…`: send a task, read a message's whole story."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest
from ninja import Field, Router, Schema, Status

from directory.routing import namespace_of
from messages.models import Message
from messages.outbound import (
    SendRequest,
    message_resend,
    message_send,
    messages_send_group,
)
from messages.rows import message_fields
from messages.selectors import message_replies, task_attempts, task_requests, task_response
from reachconsole.core.errors import ApiError
from roster.services import agent_id_parse

router = Router(tags=["a2a"])


class SendIn(Schema):
    to: str = Field(..., max_length=265,
                    description='"ns.agent", "@mention", "capability:x" or "#group"')
    payload: Any = None
    task_id: str | None = Field(None, alias="taskId", max_length=120)
    target_node_id: str | None = Field(None, alias="targetNodeId", max_length=128)
    timeout_ms: int | None = Field(None, alias="timeoutMs", ge=100, le=86_400_000)
    wait: bool = False
    from_agent_id: str | None = Field(None, alias="from", max_length=265)
    conversation_id: str = Field("", alias="conversationId", max_length=200)
    scene_group_id: str = Field("", alias="sceneGroupId", max_length=200)
    session_id: str = Field("", alias="sessionId", max_length=200)
    idempotency_key: str | None = Field(None, alias="idempotencyKey", max_length=200)


class ErrorOut(Schema):
    error: str
    detail: str


ERRORS = {400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut,
          413: ErrorOut, 422: ErrorOut}


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def message_out(row: Message) -> dict[str, Any]:
    return {
        **message_fields(row), "replyNodeId": row.reply_node_id or None,
        "idempotencyKey": row.idempotency_key or None, "inReplyTo": row.in_reply_to or None,
        "resendOf": row.resend_of.message_id if row.resend_of_id else None,
        "resolution": row.resolution,
        "createdAt": _iso(row.created_at), "publishedAt": _iso(row.published_at),
        "ackedAt": _iso(row.acked_at), "finishedAt": _iso(row.finished_at),
        "deadlineAt": _iso(row.deadline_at),
    }


WAIT_MARGIN_MS = 500
TIMEOUT_WORDS = ("the response did not arrive in time; the task may have been accepted — "
                 "query GET /api/a2a/messages/{id} later")


@router.post("/send", response={200: dict, 202: dict, **ERRORS})
async def send(request: HttpRequest, body: SendIn):
    """`to`: an agent id, `@mention`, `capability:name` or `#group` (one row per member).
    With `wait`, answers with the TASK_RESPONSE, or 202 when it does not come in time."""
    status, out = await sync_to_async(_send)(request.auth, body)
    if not body.wait or out.get("status") != "SENT":
        return Status(status, out)
    # Waiting holds no transaction and no thread: short reads between asyncio sleeps.
    deadline = time.monotonic() + ((body.timeout_ms or 30000) + WAIT_MARGIN_MS) / 1000
    pause = 0.02
    while time.monotonic() < deadline:
        await asyncio.sleep(pause)
        pause = min(pause * 1.5, 0.25)
        outcome = await sync_to_async(_task_outcome)(out["taskId"])
        if outcome is not None:
            return Status(200, outcome)
    out["detail"] = TIMEOUT_WORDS.replace("{id}", out["messageId"])
    return Status(202, out)


def _send(caller, body: SendIn) -> tuple[int, dict]:
    to = body.to.strip()
    if body.from_agent_id:
        caller.require_namespace(agent_id_parse(body.from_agent_id).namespace)
    if to.startswith(("capability:", "#", "@")):
        if caller.token.namespaces is not None and not body.from_agent_id:
            raise ApiError(403, "namespace_forbidden",
                           "a token bound to namespaces must name `from` (an agent of its "
                           "namespaces) to route by capability, group or mention")
    else:
        caller.require_namespace(agent_id_parse(to).namespace)
    if body.wait and to.startswith("#"):
        raise ApiError(422, "invalid_request", "`wait` takes one response: send to an agent, "
                       "a mention or a capability, not a group")
    send_request = SendRequest(
        to=to, payload=body.payload, task_id=body.task_id, target_node_id=body.target_node_id,
        from_agent_id=body.from_agent_id, timeout_ms=body.timeout_ms,
        conversation_id=body.conversation_id, scene_group_id=body.scene_group_id,
        session_id=body.session_id, idempotency_key=body.idempotency_key,
    )
    # A SendRefused is a ConsoleError: the API root answers it with its status and words.
    if to.startswith("#"):
        rows = messages_send_group(group=to, request=send_request, by=caller.label)
        fanned_out = rows[0].status != "UNDELIVERABLE"
        out = {"taskId": rows[0].task_id,
               "status": "FANNED_OUT" if fanned_out else "UNDELIVERABLE",
               "messages": [message_out(r) for r in rows],
               "candidates": (rows[0].resolution or {}).get("candidates", [])}
        return (202 if fanned_out else 200), out
    row = message_send(request=send_request, actor="api", by=caller.label)
    out = message_out(row)
    out["candidates"] = (row.resolution or {}).get("candidates", [])
    return (202 if row.status == "SENT" else 200), out


FINAL = {"COMPLETED", "TASK_ERROR", "UNDELIVERABLE", "FAILED", "NACKED", "EXPIRED", "BUSY"}


def _task_outcome(task_id: str) -> dict | None:
    """The task's answer once it has one: its response, or how its last attempt ended."""
    attempts = task_requests(task_id)
    answered = [m for m in attempts if m.status in ("COMPLETED", "TASK_ERROR")]
    if answered:
        row = answered[-1]
        out = message_out(row)
        response = task_response(row)
        out["response"] = response.payload if response else None
        return out
    last = attempts[-1] if attempts else None
    if last is not None and last.status in FINAL:
        return message_out(last)
    return None


@router.get("/messages/{message_id}", response={200: dict, **ERRORS})
def message_detail(request: HttpRequest, message_id: str):
    row = Message.objects.select_related("resend_of").filter(message_id=message_id).first()
    if row is None:
        raise ApiError(404, "message_not_found", f"no message {message_id[:200]} is recorded")
    namespaces = request.auth.token.namespaces
    if namespaces is not None:
        touched = {namespace_of(a) for a in (row.from_agent_id, row.to_agent_id)} - {None}
        if not touched & namespaces:
            raise ApiError(403, "namespace_forbidden",
                           "this service token is bound to other namespaces than this "
                           "message's agents")
    out = message_out(row)
    out["payload"] = row.payload
    out["headers"] = row.headers
    out["transitions"] = [
        {"from": t.from_status or None, "to": t.to_status, "at": t.at.isoformat(),
         "reason": t.reason or None, "actor": t.actor, "by": t.by or None}
        for t in row.transitions.all()
    ]
    out["attempts"] = [
        {"messageId": m.message_id, "attempt": m.attempt, "status": m.status}
        for m in task_attempts(row)
    ]
    out["replies"] = [
        {"messageId": m.message_id, "messageType": m.message_type, "status": m.status,
         "payload": m.payload, "createdAt": m.created_at.isoformat()}
        for m in message_replies(row)
    ]
    return Status(200, out)


class ResendIn(Schema):
    new_idempotency_key: bool = Field(False, alias="newIdempotencyKey")


@router.post("/messages/{message_id}/resend", response={202: dict, 200: dict, **ERRORS})
def resend(request: HttpRequest, message_id: str, body: ResendIn | None = None):
    """A new transmission of the same task (same task id; the same idempotency key unless
    `newIdempotencyKey`, which asks the receiver to run the work again)."""
    body = body or ResendIn()
    previous = Message.objects.filter(message_id=message_id).first()
    if previous is not None:
        namespace = namespace_of(previous.to_agent_id)
        if namespace:
            request.auth.require_namespace(namespace)
    row = message_resend(message_id=message_id, by=request.auth.label,
                         new_idempotency_key=body.new_idempotency_key)
    out = message_out(row)
    if body.new_idempotency_key:
        out["warning"] = ("sent with a new idempotency key: the receiver will run the work "
                          "again even if it already ran it")
    return Status(202 if row.status == "SENT" else 200, out)
