"""Sending: every send is a row first, then a resolution, then (outside the transaction) a
publish by the bridge. PROTOCOL.md "Outbound state machine"."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from directory.resolver import Resolution, resolve, resolve_agent_node
from directory.routing import group_members, isolation_refusal, namespace_of, route_capability
from messages import protocol
from messages.events import events_on_commit, message_events
from messages.handlers import LOCAL_HANDLERS
from messages.models import INFLIGHT_STATUSES, Direction, Message, Status, Transition
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
    to: str  # "ns.agent", "@mention", or "capability:name" (groups: messages_send_group)
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


CAPABILITY_PREFIX = "capability:"


def unacked_counts(agent_ids: list[str]) -> dict[str, int]:
    """What the console has sent each agent and not yet seen acknowledged."""
    rows = (Message.objects.filter(direction=Direction.SEND, to_agent_id__in=agent_ids,
                                   status__in=list(INFLIGHT_STATUSES))
            .values("to_agent_id").annotate(n=Count("id")))
    return {row["to_agent_id"]: row["n"] for row in rows}


def _resolve_target(request: SendRequest, now: datetime) -> tuple[str, Resolution]:
    """(the agent id to record, the directory's answer) for one send."""
    to = request.to.strip()
    if to.startswith(CAPABILITY_PREFIX):
        capability = to[len(CAPABILITY_PREFIX):].strip()
        if not capability:
            raise SendRefused("name the capability: `capability:web_search`")
        resolution = route_capability(capability=capability, from_agent_id=request.from_agent_id,
                                      unacked=unacked_counts, now=now)
        return resolution.agent_id or to, resolution
    if to.startswith("@"):
        resolution = resolve(mention=to, target_node_id=request.target_node_id,
                             namespace=namespace_of(request.from_agent_id), now=now)
        return resolution.agent_id or to, resolution
    agent_id = agent_id_parse(to).agent_id
    return agent_id, resolve_agent_node(to_agent_id=agent_id,
                                        target_node_id=request.target_node_id or None, now=now)


def message_send(*, request: SendRequest, actor: str = "api", by: str = "",
                 now: datetime | None = None) -> Message:
    """Record a TASK_REQUEST and route it. Returns the row in its resulting status.

    SENT (handed to the bridge after commit), LOCAL_CONSUMED, or UNDELIVERABLE with the
    reason and the candidates considered. Input the console cannot send at all raises
    SendRefused and writes nothing.
    """
    now = now or timezone.now()
    to_agent_id, resolution = _resolve_target(request, now)
    if resolution.ok:
        refusal = isolation_refusal(from_agent_id=request.from_agent_id,
                                    to_agent_id=resolution.agent_id)
        if refusal:
            raise SendRefused(refusal, code="namespace_isolation", status=403)
    row = _request_row(request, to_agent_id=to_agent_id, now=now)
    row.resolution = {
        "target": request.to, "level": resolution.level, "match": resolution.match,
        "reason": resolution.reason, "candidates": [c.as_dict() for c in resolution.candidates],
    }
    with transaction.atomic():
        row.save(force_insert=True)
        transition_first(row, actor=actor, by=by, reason=f"to {request.to}")
        events = message_events(row, previous="") + _route(row, resolution, actor=actor, now=now)
        events_on_commit(events)
    return row


def _request_row(request: SendRequest, *, to_agent_id: str, now: datetime) -> Message:
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
    return row


def _route(row: Message, resolution: Resolution, *, actor: str, now: datetime) -> list[dict]:
    """Move a fresh SENT row on: consumed here, undeliverable, or handed to the bridge."""
    if resolution.local:
        return _consume_locally(row, now=now, actor=actor)
    if not resolution.ok:
        reason = undeliverable_reason(resolution)
        _warn_once(row.to_agent_id, resolution.reason)
        return _move(row, Status.UNDELIVERABLE, reason=reason, actor=actor, now=now,
                     error=reason, finished_at=now)
    row.target_node_id = resolution.node_id
    row.topic = protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX, resolution.node_id)
    row.save(update_fields=["target_node_id", "topic"])
    transaction.on_commit(lambda: publish_request([row.pk]))
    return []


def messages_send_group(*, group: str, request: SendRequest, actor: str = "api", by: str = "",
                        now: datetime | None = None) -> list[Message]:
    """Fan a task out to every routable member of `#group`: one row per member, one task id,
    so each member's delivery is tracked on its own."""
    now = now or timezone.now()
    members = group_members(group=group, from_agent_id=request.from_agent_id, now=now)
    live = [m for m in members if m.routable]
    task_id = request.task_id or f"task-{uuid.uuid4()}"
    shared = {"target": f"#{group.lstrip('#')}", "level": "group",
              "candidates": [m.as_dict() for m in members]}
    if not live:
        reason = (f"group #{group.lstrip('#')} has no member that can take work now"
                  if members else f"group #{group.lstrip('#')} has no members you may reach")
        resolution = Resolution(None, None, "group", reason, members, outcome="not_found")
        row = _request_row(replace(request, task_id=task_id), to_agent_id=shared["target"],
                           now=now)
        row.resolution = {**shared, "reason": reason}
        with transaction.atomic():
            row.save(force_insert=True)
            transition_first(row, actor=actor, by=by, reason=f"to {shared['target']}")
            events_on_commit(message_events(row, previous="")
                             + _route(row, resolution, actor=actor, now=now))
        return [row]
    rows = []
    with transaction.atomic():
        events: list[dict] = []
        for member in live:
            row = _request_row(replace(request, task_id=task_id, to=member.agent_id),
                               to_agent_id=member.agent_id, now=now)
            # Each member executes its own copy: its own idempotency key within the task.
            row.idempotency_key = row.headers["idempotencyKey"] = f"{task_id}:{member.agent_id}"
            row.resolution = {**shared, "reason": f"member of {shared['target']}"}
            row.save(force_insert=True)
            transition_first(row, actor=actor, by=by, reason=f"to {shared['target']}")
            member_resolution = Resolution(member.agent_id, member.node_id, "group", "member",
                                           [member])
            events += message_events(row, previous="") + _route(row, member_resolution,
                                                                  actor=actor, now=now)
            rows.append(row)
        events_on_commit(events)
    return rows


def message_reroute(*, busy: Message, now: datetime) -> Message | None:
    """After a BUSY answer to a capability send: the same task to the next candidate.

    A new transmission (new message id, same task id and idempotency key, attempt + 1,
    linked to the busy one); None when no other agent can take it. Runs inside the caller's
    transaction; the caller publishes the returned row after commit.
    """
    target = (busy.resolution or {}).get("target", "")
    if not target.startswith(CAPABILITY_PREFIX):
        return None
    tried = set(Message.objects.filter(task_id=busy.task_id, direction=Direction.SEND)
                .values_list("to_agent_id", flat=True))
    resolution = route_capability(capability=target[len(CAPABILITY_PREFIX):],
                                  from_agent_id=busy.from_agent_id, exclude=tried,
                                  unacked=unacked_counts, now=now)
    if not resolution.ok:
        return None
    request = SendRequest(
        to=target, payload=busy.payload, task_id=busy.task_id,
        from_agent_id=busy.from_agent_id, timeout_ms=busy.headers.get("timeoutMs"),
        conversation_id=busy.conversation_id, scene_group_id=busy.scene_group_id,
        session_id=busy.session_id, idempotency_key=busy.idempotency_key,
        attempt=busy.attempt + 1, resend_of=busy,
    )
    row = _request_row(request, to_agent_id=resolution.agent_id, now=now)
    row.resolution = {"target": target, "level": "capability", "match": "capability",
                      "reason": f"re-routed after BUSY from {busy.to_agent_id}",
                      "candidates": [c.as_dict() for c in resolution.candidates]}
    row.target_node_id = resolution.node_id
    row.topic = protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX, resolution.node_id)
    row.save(force_insert=True)
    transition_first(row, actor="bridge", reason=f"re-routed after BUSY from {busy.to_agent_id}")
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
