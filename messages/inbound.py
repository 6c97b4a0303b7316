"""What the bridge does with a batch of MQTT messages, in PROTOCOL.md's order:

1. reject and count what is not an A2A envelope (never crash, never a half row);
2. drop self-originated messages (heartbeats by `originNodeId` only);
3. answer a duplicate TASK_REQUEST (same idempotency key in the window) with ACK
   `duplicate: true`, without executing or storing it again;
4. store each message once (`ON CONFLICT DO NOTHING`), then act only on rows this call
   inserted: ACK/NACK/BUSY move the acknowledged send, TASK_RESPONSE completes its request,
   HEARTBEAT renews leases through the roster, a request to a console agent runs once.

One transaction per batch; the bridge acknowledges the batch to the broker after it commits.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from messages import protocol
from messages.delivery import retry_or_give_up
from messages.events import events_on_commit, message_events
from messages.handlers import LOCAL_HANDLERS
from messages.idempotency import idempotency_claim, idempotency_release
from messages.load import held_release
from messages.models import Direction, Message, Status
from messages.outbound import message_reroute
from messages.rows import ReceivedRow, received_row, reply_row
from messages.state import Change, atomic_retrying, changes_apply, messages_insert_new
from roster.services import heartbeat_record

log = logging.getLogger(__name__)
MT = protocol.MessageType

# An answered transmission leaves the ack-deadline index (the sweep costs what is due).
ANSWERED = {"ack_deadline_at": None}
_last_logged: dict[str, float] = {}


def _log_once_a_minute(reason: str, detail: str) -> None:
    now = time.monotonic()
    if now - _last_logged.get(reason, -120.0) >= 60.0:
        _last_logged[reason] = now
        log.warning("rejected an MQTT payload (%s): %s", reason, detail)


@dataclass(frozen=True, slots=True)
class Incoming:
    topic: str
    payload: bytes
    received_at: datetime | None = None


@dataclass
class IngestResult:
    stored: int = 0
    to_publish: list[int] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    busy: list[int] = field(default_factory=list)  # capability sends answered BUSY


def _is_self(env: protocol.Envelope, node_id: str) -> bool:
    if env.message_type == MT.HEARTBEAT:
        return env.origin_node_id == node_id
    return env.from_agent_id == node_id or env.from_agent_id in LOCAL_HANDLERS


def messages_ingest(*, batch: list[Incoming], node_id: str, prefix: str,
                    now: datetime | None = None) -> IngestResult:
    now = now or timezone.now()
    result = IngestResult()
    counts = result.counts
    rows: list[ReceivedRow] = []
    heartbeats: list[tuple[str, protocol.Envelope]] = []
    for item in batch:
        match = protocol.parse_topic(prefix, item.topic)
        if match is None:
            counts["rejected:unknown_topic"] += 1
            _log_once_a_minute("unknown_topic", f"topic {item.topic[:200]!r}")
            continue
        env = protocol.decode(item.payload, max_bytes=settings.REACH_MAX_MESSAGE_BYTES)
        if isinstance(env, protocol.Rejection):
            counts[f"rejected:{env.reason.value}"] += 1
            _log_once_a_minute(env.reason.value, f"on {item.topic[:200]}: {env.detail}")
            continue
        if _is_self(env, node_id):
            counts["dropped_self"] += 1
            continue
        if match.kind == "heartbeat":
            if env.message_type != MT.HEARTBEAT:
                counts["rejected:not_a_heartbeat"] += 1
                _log_once_a_minute("not_a_heartbeat", f"{env.message_type} on {item.topic}")
                continue
            heartbeats.append((match.node_id, env))
            continue
        direction = Direction.RECV if match.node_id == node_id else Direction.OBSERVED
        rows.append(received_row(env, topic=item.topic, direction=direction, now=now))

    if heartbeats:
        # Their own short transaction: they lock roster rows, which the message batch
        # should not hold while it waits for message rows (lock order, no deadlocks).
        with transaction.atomic():
            for hb_node, env in heartbeats:
                _heartbeat(hb_node, env, now=now, counts=counts)
    claims: list[tuple[str, str]] = []
    try:
        _ingest_rows(rows, node_id=node_id, now=now, result=result, claims=claims)
    except BaseException:
        idempotency_release(node_id=node_id, claims=claims)
        raise
    for pk in result.busy:
        # Each in a transaction of its own, after the batch's: a new attempt takes its
        # task's lock first (messages/load.py, the lock order), which a transaction already
        # holding message and load rows must not wait for.
        atomic_retrying(lambda pk=pk: _reroute(pk, now=now, result=result))
    return result


def _reroute(pk: int, *, now: datetime, result: IngestResult) -> None:
    busy = Message.objects.filter(pk=pk, status=Status.BUSY).first()
    if busy is None:
        return
    rerouted, publish, events = message_reroute(busy=busy, now=now)
    if rerouted is not None:
        result.counts["rerouted_after_busy"] += 1
        result.to_publish += publish
        events_on_commit(events)


def _ingest_rows(rows: list[ReceivedRow], *, node_id: str, now: datetime, result: IngestResult,
                 claims: list[tuple[str, str]]) -> None:
    if not rows:
        return
    counts = result.counts
    with transaction.atomic():
        duplicates, rows = _split_duplicates(rows, node_id=node_id, claims=claims)
        fresh = messages_insert_new(rows)
        counts["duplicate_message_id"] += len(rows) - len(fresh)
        counts["stored"] += len(fresh)
        result.stored = len(fresh)
        events: list[dict] = []
        for row in fresh:
            events += message_events(row, previous="")
        changes: list[Change] = []
        replies: list[Message] = []
        for row in duplicates:
            counts["duplicate_idempotency_key"] += 1
            ack = reply_row(to=row, message_type=MT.ACK, payload={"duplicate": True}, now=now,
                            extra_headers={"ackFor": row.message_id})
            if ack:
                replies.append(ack)
        for row in fresh:
            _act(row, changes=changes, replies=replies, now=now)
        _retry_retryable_nacks(changes, now=now)
        applied = changes_apply(changes, now=now)
        events += applied.events
        counts["stale_answers"] += applied.skipped
        result.busy += [m.pk for m in applied.messages
                        if m.status == Status.BUSY and m.direction == Direction.SEND]
        if applied.freed:
            publish, undeliverable = held_release(agent_ids=applied.freed, now=now)
            result.to_publish += publish
            events += changes_apply(undeliverable, now=now).events
        sent = messages_insert_new(replies)
        for reply in sent:
            events += message_events(reply, previous="")
        result.to_publish += [reply.pk for reply in sent]
        events_on_commit(events)


def _retry_retryable_nacks(changes: list[Change], *, now: datetime) -> None:
    """A retryable NACK schedules the next attempt (RETRYING) instead of ending the send,
    while attempts and the task's time remain."""
    retryable = {c.message_id: c for c in changes if c.retryable}
    if not retryable:
        return
    for row in Message.objects.filter(message_id__in=list(retryable), direction=Direction.SEND):
        status, fields, why = retry_or_give_up(row, now=now)
        change = retryable[row.message_id]
        if status:
            change.to = status
            change.fields = {"error": change.fields["error"], **ANSWERED, **fields}
            change.reason = f"{change.reason}; {why}"
        else:
            change.reason = f"{change.reason}; no retry: {why}"


def _heartbeat(node_id: str, env: protocol.Envelope, *, now: datetime, counts: Counter) -> None:
    payload = env.payload if isinstance(env.payload, dict) else {}
    agents = payload.get("agents") if isinstance(payload.get("agents"), list) else []
    beat_ms = payload.get("heartbeatMs")
    outcome = heartbeat_record(
        node_id=node_id, agents=agents, now=now,
        heartbeat_ms=beat_ms if isinstance(beat_ms, int) and beat_ms > 0 else None,
    )
    counts["heartbeats"] += 1
    counts["heartbeat_conflicts"] += len(outcome.conflicts)


def _split_duplicates(rows: list[ReceivedRow], *, node_id: str, claims: list[tuple[str, str]]
                      ) -> tuple[list[ReceivedRow], list[ReceivedRow]]:
    """TASK_REQUESTs to this node whose work another transmission already claimed in the
    idempotency window (messages/idempotency.py). Keys claimed here are added to `claims`
    so the caller can give them back if the batch does not commit."""
    duplicates, keep = [], []
    for row in rows:
        if row.direction == Direction.RECV and row.message_type == MT.TASK_REQUEST:
            if not idempotency_claim(node_id=node_id, key=row.idempotency_key,
                                     message_id=row.message_id):
                duplicates.append(row)
                continue
            claims.append((row.idempotency_key, row.message_id))
        keep.append(row)
    return duplicates, keep


def _act(row: ReceivedRow, *, changes: list[Change], replies: list[Message], now: datetime) -> None:
    kind = row.message_type
    headers = row.headers or {}
    payload = row.payload if isinstance(row.payload, dict) else {}
    ack_for = headers.get("ackFor") if isinstance(headers.get("ackFor"), str) else None
    if kind == MT.ACK and ack_for:
        changes.append(Change(message_id=ack_for, to=Status.ACKED,
                              reason="ACK" + (" (duplicate)" if payload.get("duplicate") else ""),
                              actor="bridge", fields={"acked_at": now, **ANSWERED}))
    elif kind == MT.NACK and ack_for:
        reason = str(payload.get("reason") or "refused by the receiver")[:2000]
        retry = "retryable" if payload.get("retryable") is True else "not retryable"
        error = f"{row.from_agent_id or 'the receiver'} refused it ({retry}): {reason}"
        nacked = Change(message_id=ack_for, to=Status.NACKED,
                        reason=f"NACK ({retry}): {reason}", actor="bridge",
                        fields={"error": error, "finished_at": now, **ANSWERED})
        nacked.retryable = retry == "retryable"
        changes.append(nacked)
    elif kind == MT.BUSY and ack_for:
        changes.append(Change(message_id=ack_for, to=Status.BUSY,
                              reason="BUSY: the receiver's queue is full", actor="bridge",
                              fields={"error": "the receiver's queue was full (BUSY)",
                                      **ANSWERED}))
    elif kind == MT.TASK_RESPONSE and row.in_reply_to:
        ok = payload.get("ok", True) is not False
        error = "" if ok else f"the task failed: {str(payload.get('error'))[:2000]}"
        changes.append(Change(message_id=row.in_reply_to,
                              to=Status.COMPLETED if ok else Status.TASK_ERROR,
                              reason="TASK_RESPONSE", actor="bridge",
                              fields={"finished_at": now, "error": error, **ANSWERED}))
        if row.direction == Direction.RECV:
            ack = reply_row(to=row, message_type=MT.ACK, payload={}, now=now,
                            extra_headers={"ackFor": row.message_id})
            if ack:
                replies.append(ack)
    elif kind == MT.TASK_REQUEST and row.direction == Direction.RECV:
        _request_to_console(row, changes=changes, replies=replies, now=now)
    elif kind == MT.DRAIN and row.direction == Direction.RECV:
        ack = reply_row(to=row, message_type=MT.ACK, payload={}, now=now,
                        extra_headers={"ackFor": row.message_id})
        if ack:
            replies.append(ack)


def _request_to_console(row: ReceivedRow, *, changes: list[Change], replies: list[Message],
                        now: datetime) -> None:
    handler = LOCAL_HANDLERS.get(row.to_agent_id)
    ack_headers = {"ackFor": row.message_id}
    if handler is None:
        nack = reply_row(to=row, message_type=MT.NACK, now=now, extra_headers=ack_headers,
                         payload={"reason": f"node {settings.REACH_NODE_ID} hosts no agent "
                                  f"{row.to_agent_id or '(none named)'}", "retryable": False})
        if nack:
            replies.append(nack)
        return
    # Consumed here and only here: this row was just inserted, so no other path has it.
    changes.append(Change(pk=row.pk, to=Status.LOCAL_CONSUMED, allowed=frozenset({Status.RECV}),
                          reason="handled by the console", actor="bridge",
                          fields={"finished_at": now}))
    ack = reply_row(to=row, message_type=MT.ACK, payload={}, now=now, extra_headers=ack_headers)
    try:
        response_payload = {"ok": True, "result": handler(row.payload)}
    except Exception as exc:  # a handler's failure is the task's answer, not the bridge's
        log.exception("local handler %s failed", row.to_agent_id)
        response_payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    response = reply_row(to=row, message_type=MT.TASK_RESPONSE, payload=response_payload,
                         now=now, extra_headers={"inReplyTo": row.message_id})
    replies += [r for r in (ack, response) if r]
