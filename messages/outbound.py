"""Sending: every send is a row first, then a resolution, then (outside the transaction) a
publish by the bridge. PROTOCOL.md "Outbound state machine"."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from directory.resolver import Resolution, resolve_agent_node
from messages import protocol
from messages.events import events_on_commit, message_events
from messages.handlers import LOCAL_HANDLERS
from messages.models import Direction, Message, Status, Transition
from messages.state import transition_first
from roster.services import agent_id_parse

log = logging.getLogger(__name__)

_warned: dict[str, float] = {}
WARN_EVERY_S = 60.0


class SendRefused(Exception):
    """The send is not accepted at all: nothing is written."""

    code = "send_refused"
    status = 422

    def __init__(self, detail: str, *, code: str | None = None, status: int | None = None):
        super().__init__(detail)
        self.detail = detail
        if code:
            self.code = code
        if status:
            self.status = status


def _warn_once(agent_id: str, reason: str) -> None:
    last = _warned.get(agent_id, 0.0)
    if time.monotonic() - last > WARN_EVERY_S:
        _warned[agent_id] = time.monotonic()
        log.warning("undeliverable to %s: %s", agent_id, reason)


def envelope_from_row(message: Message) -> protocol.Envelope:
    return protocol.Envelope(
        message_id=message.message_id,
        message_type=protocol.MessageType(message.message_type),
        task_id=message.task_id or None,
        from_agent_id=message.from_agent_id or None,
        to_agent_id=message.to_agent_id or None,
        target_node_id=message.target_node_id or None,
        conversation_id=message.conversation_id or None,
        scene_group_id=message.scene_group_id or None,
        session_id=message.session_id or None,
        timestamp=int(message.created_at.timestamp() * 1000),
        headers=dict(message.headers or {}),
        payload=message.payload,
    )


def undeliverable_reason(resolution: Resolution) -> str:
    if not resolution.candidates:
        return resolution.reason
    considered = "; ".join(
        f"{c.agent_id} on {c.node_id}: {c.why}" for c in resolution.candidates
    )
    return f"{resolution.reason}. Considered: {considered}"


@dataclass(frozen=True, slots=True)
class SendRequest:
    to_agent_id: str
    payload: Any = None
    task_id: str | None = None
    target_node_id: str | None = None
    from_agent_id: str | None = None
    timeout_ms: int | None = None
    conversation_id: str = ""
    scene_group_id: str = ""
    session_id: str = ""
    idempotency_key: str | None = None
    attempt: int = 1
    resend_of: Message | None = None


def message_send(*, request: SendRequest, actor: str = "api", by: str = "",
                 now: datetime | None = None) -> Message:
    """Record a TASK_REQUEST and route it. Returns the row in its resulting status.

    SENT (handed to the bridge after commit), LOCAL_CONSUMED, or UNDELIVERABLE with the
    reason and the candidates considered. Input the console cannot send at all raises
    SendRefused and writes nothing.
    """
    now = now or timezone.now()
    ref = agent_id_parse(request.to_agent_id)
    to_agent_id = ref.agent_id
    node_id = settings.REACH_NODE_ID
    message_id = str(uuid.uuid4())
    task_id = request.task_id or f"task-{message_id}"
    timeout_ms = request.timeout_ms or 30000
    headers = {
        "replyNodeId": node_id,
        "originNodeId": node_id,
        "idempotencyKey": request.idempotency_key or task_id,
        "timeoutMs": timeout_ms,
        "attempt": request.attempt,
    }
    row = Message(
        message_id=message_id, task_id=task_id, idempotency_key=headers["idempotencyKey"],
        message_type=protocol.MessageType.TASK_REQUEST, direction=Direction.SEND,
        status=Status.SENT, from_agent_id=request.from_agent_id or node_id,
        to_agent_id=to_agent_id, target_node_id=request.target_node_id or "",
        origin_node_id=node_id, reply_node_id=node_id,
        conversation_id=request.conversation_id, scene_group_id=request.scene_group_id,
        session_id=request.session_id, headers=headers, payload=request.payload,
        attempt=request.attempt, resend_of=request.resend_of, created_at=now, updated_at=now,
        deadline_at=now + timedelta(milliseconds=timeout_ms),
    )
    try:
        protocol.encode(envelope_from_row(row), max_bytes=settings.REACH_MAX_MESSAGE_BYTES)
    except protocol.PayloadTooLarge as exc:
        raise SendRefused(str(exc), code="payload_too_large", status=413) from None
    except (TypeError, ValueError) as exc:
        raise SendRefused(f"the payload cannot be sent as JSON: {exc}") from None

    resolution = resolve_agent_node(
        to_agent_id=to_agent_id, target_node_id=request.target_node_id or None, now=now
    )
    row.resolution = {
        "level": resolution.level, "reason": resolution.reason,
        "candidates": [c.as_dict() for c in resolution.candidates],
    }
    with transaction.atomic():
        row.save(force_insert=True)
        transition_first(row, actor=actor, by=by, reason=f"to {to_agent_id}")
        events = message_events(row, previous="")
        if resolution.local:
            events += _consume_locally(row, now=now, actor=actor)
        elif not resolution.ok:
            reason = undeliverable_reason(resolution)
            events += _move(row, Status.UNDELIVERABLE, reason=reason, actor=actor, now=now,
                            error=reason, finished_at=now)
            _warn_once(to_agent_id, resolution.reason)
        else:
            row.target_node_id = resolution.node_id
            row.topic = protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX, resolution.node_id)
            row.save(update_fields=["target_node_id", "topic"])
            transaction.on_commit(lambda: publish_request([row.pk]))
        events_on_commit(events)
    return row


def _move(row: Message, to: str, *, reason: str, actor: str, now: datetime,
          **fields: Any) -> list[dict]:
    previous = row.status
    row.status = to
    row.updated_at = now
    for name, value in fields.items():
        setattr(row, name, value)
    row.save(update_fields=["status", "updated_at", *fields])
    Transition.objects.create(message=row, from_status=previous, to_status=to, at=now,
                              reason=reason, actor=actor)
    return message_events(row, previous=previous, reason=reason)


def _consume_locally(row: Message, *, now: datetime, actor: str) -> list[dict]:
    """The console's own agents answer in-process: the request is consumed once, here."""
    handler = LOCAL_HANDLERS[row.to_agent_id]
    row.target_node_id = settings.REACH_NODE_ID
    events = _move(row, Status.LOCAL_CONSUMED, reason="handled by the console", actor=actor,
                   now=now, finished_at=now, target_node_id=row.target_node_id)
    response = Message(
        message_id=str(uuid.uuid4()), task_id=row.task_id, idempotency_key=row.idempotency_key,
        message_type=protocol.MessageType.TASK_RESPONSE, direction=Direction.RECV,
        status=Status.RECV, from_agent_id=row.to_agent_id, to_agent_id=row.from_agent_id,
        target_node_id=settings.REACH_NODE_ID, origin_node_id=settings.REACH_NODE_ID,
        conversation_id=row.conversation_id, scene_group_id=row.scene_group_id,
        session_id=row.session_id, headers={"inReplyTo": row.message_id},
        payload={"ok": True, "result": handler(row.payload)}, in_reply_to=row.message_id,
        created_at=now, updated_at=now, finished_at=now,
    )
    response.save(force_insert=True)
    return events + message_events(response, previous="")


def reply_row(*, to: Message, message_type: str, payload: Any, now: datetime,
              extra_headers: dict | None = None) -> Message | None:
    """An ACK/NACK/TASK_RESPONSE answering `to`, addressed to its reply node; None when the
    sender left no way to answer (no replyNodeId)."""
    node_id = settings.REACH_NODE_ID
    reply_node = to.reply_node_id or ""
    if not reply_node:
        return None
    headers = {"originNodeId": node_id, "replyNodeId": node_id, **(extra_headers or {})}
    return Message(
        message_id=str(uuid.uuid4()), task_id=to.task_id, idempotency_key="",
        message_type=message_type, direction=Direction.SEND, status=Status.SENT,
        from_agent_id=to.to_agent_id or node_id, to_agent_id=to.from_agent_id,
        target_node_id=reply_node, origin_node_id=node_id, reply_node_id=node_id,
        conversation_id=to.conversation_id, scene_group_id=to.scene_group_id,
        session_id=to.session_id,
        topic=protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX, reply_node),
        headers=headers, payload=payload,
        in_reply_to=headers.get("inReplyTo") or headers.get("ackFor") or "",
        created_at=now, updated_at=now,
    )


def publish_request(pks: list[int]) -> None:
    """Hand rows to the bridge for publishing: in-process when a bridge runs here, else
    through Celery to the worker that runs one."""
    from messages import runtime

    bridge = runtime.current_bridge()
    if bridge is not None:
        bridge.submit(pks)
        return
    from messages.tasks import messages_publish

    messages_publish.delay(pks)


def payload_text(message: Message) -> str:
    return json.dumps(message.payload, ensure_ascii=False, indent=2)
