"""Every `a2a_message` row is built here, and serialized here: requests of ours, our answers
(ACK/NACK/TASK_RESPONSE), the console agents' own responses, and received rows; the wire
envelope of a row, the one set of fields that the API and the events both show, and the JSON
text of a batch of rows that PostgreSQL takes apart (`json_text`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import msgspec
from django.conf import settings

from messages import protocol, signing
from messages.models import Direction, Message, Status
from reachconsole.core.logs import log_fields


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


def row_encode(message: Message) -> bytes:
    """The bytes published for a row of ours: its envelope, signed with the key of the node
    it goes to when the console holds keys (messages/signing.py). Raises as protocol.encode
    does (PayloadTooLarge, ValueError, TypeError)."""
    keyring = signing.keyring_for(settings.REACH_SIGNING_KEYS)
    node = (protocol.inbox_node_of(message.topic or "") or message.target_node_id
            or settings.REACH_NODE_ID)
    return protocol.encode(envelope_from_row(message), max_bytes=settings.REACH_MAX_MESSAGE_BYTES,
                           key=keyring.signing_key(node) if keyring else None)


# A task's deadline when its request names no timeoutMs, and the longest the console keeps
# one open (the API's own bound on timeoutMs).
DEFAULT_TIMEOUT_MS = 30000
MAX_TIMEOUT_MS = 86_400_000


def request_row(*, request: Any, to_agent_id: str, now: datetime) -> Message:
    """A TASK_REQUEST of ours (a messages.outbound.SendRequest), SENT, not yet routed."""
    node_id = settings.REACH_NODE_ID
    message_id = str(uuid.uuid4())
    task_id = request.task_id or f"task-{message_id}"
    timeout_ms = request.timeout_ms or DEFAULT_TIMEOUT_MS
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
    return row


def reply_row(*, to: Any, message_type: str, payload: Any, now: datetime,
              extra_headers: dict | None = None, to_node: str | None = None,
              due: bool = True) -> Message | None:
    """An ACK/NACK/TASK_RESPONSE answering `to`, addressed to its reply node (or `to_node`);
    None when the sender left no way to answer (no replyNodeId). A row not `due` waits in
    the outbox until something makes it due (a response waits for its ACK: bridge.py)."""
    node_id = settings.REACH_NODE_ID
    reply_node = to_node if to_node is not None else (to.reply_node_id or "")
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
        # Due in the outbox now; an answer the broker has not taken within the idempotency
        # window is of no use to its receiver any more, and ends FAILED there.
        publish_at=now if due else None,
        deadline_at=now + timedelta(seconds=settings.REACH_IDEMPOTENCY_TTL_S),
    )


def cancel_row(*, request: Message, now: datetime) -> Message:
    """The CANCEL (console → node) that tells the node a request of ours went to that its
    task is canceled: headers.cancelFor = the task id (PROTOCOL.md, "Tasks, numbers and
    alarms"). Due in the outbox now; of no use past the idempotency window."""
    node_id = settings.REACH_NODE_ID
    headers = {"originNodeId": node_id, "replyNodeId": node_id, "cancelFor": request.task_id}
    return Message(
        message_id=str(uuid.uuid4()), task_id=request.task_id, idempotency_key="",
        message_type=protocol.MessageType.CANCEL, direction=Direction.SEND, status=Status.SENT,
        from_agent_id=request.from_agent_id or node_id, to_agent_id=request.to_agent_id,
        target_node_id=request.target_node_id, origin_node_id=node_id, reply_node_id=node_id,
        conversation_id=request.conversation_id, scene_group_id=request.scene_group_id,
        session_id=request.session_id,
        topic=protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX, request.target_node_id),
        headers=headers, payload={"taskId": request.task_id, "messageId": request.message_id},
        created_at=now, updated_at=now, publish_at=now,
        deadline_at=now + timedelta(seconds=settings.REACH_IDEMPOTENCY_TTL_S),
    )


def rejection_reply_row(*, rejection: protocol.Rejection, now: datetime) -> Message | None:
    """The NACK (not retryable) that tells the origin of a request the decoder rejected why;
    None unless the rejection names the message and a valid origin node."""
    if not (rejection.message_id and rejection.origin_node_id):
        return None
    return reply_row(
        to=Message(message_id=rejection.message_id), message_type=protocol.MessageType.NACK,
        payload={"reason": f"rejected ({rejection.reason.value}): {rejection.detail}",
                 "retryable": False},
        now=now, extra_headers={"ackFor": rejection.message_id},
        to_node=rejection.origin_node_id)


def local_response_row(*, request: Message, payload: Any, now: datetime) -> Message:
    """The TASK_RESPONSE a console agent gives in-process to `request` (stored as received):
    `payload` is `{"ok": true, "result": …}` or `{"ok": false, "error": …}`."""
    node_id = settings.REACH_NODE_ID
    return Message(
        message_id=str(uuid.uuid4()), task_id=request.task_id,
        idempotency_key=request.idempotency_key,
        message_type=protocol.MessageType.TASK_RESPONSE, direction=Direction.RECV,
        status=Status.RECV, from_agent_id=request.to_agent_id,
        to_agent_id=request.from_agent_id, target_node_id=node_id, origin_node_id=node_id,
        conversation_id=request.conversation_id, scene_group_id=request.scene_group_id,
        session_id=request.session_id, headers={"inReplyTo": request.message_id},
        payload=payload, in_reply_to=request.message_id,
        created_at=now, updated_at=now, finished_at=now,
    )


@dataclass(slots=True)
class ReceivedRow:
    """An inbound message on its way into `a2a_message`: the table's columns as plain
    attributes. A Django model instance per message was the largest single cost of ingest
    (docs/performance.md); the insert, the events and the rules only read attributes."""

    message_id: str
    task_id: str
    idempotency_key: str
    message_type: str
    direction: str
    status: str
    from_agent_id: str
    to_agent_id: str
    target_node_id: str
    origin_node_id: str
    reply_node_id: str
    conversation_id: str
    scene_group_id: str
    session_id: str
    topic: str
    headers: dict
    payload: object
    attempt: int
    in_reply_to: str
    created_at: datetime
    updated_at: datetime
    error: str = ""
    resolution: dict | None = None
    resend_of_id: int | None = None
    published_at: datetime | None = None
    acked_at: datetime | None = None
    finished_at: datetime | None = None
    deadline_at: datetime | None = None
    publish_at: datetime | None = None
    ack_deadline_at: datetime | None = None
    next_attempt_at: datetime | None = None
    held: bool = False
    payload_dropped_at: datetime | None = None
    pk: int | None = None
    # Not a column: the payload as it came, which the inbound rules read (an OBSERVED row
    # may be stored without it).
    wire_payload: object = None
    # Not a column: why its signature keeps it from changing anything ("" when nothing
    # does; messages/signing.py), which the inbound rules read.
    signature_refused: str = ""


def received_row(env: protocol.Envelope, *, topic: str, direction: str, now: datetime,
                 store_observed: bool | None = None) -> ReceivedRow:
    """An inbound message as it is stored: RECV on our inbox, OBSERVED elsewhere. Traffic
    between other nodes is stored without its payload unless REACH_STORE_OBSERVED_PAYLOADS
    (it is theirs, and the console never resends it); the console's own keep theirs until
    REACH_PAYLOAD_KEEP_HOURS (messages/sweeps.payloads_drop).
    `store_observed`: that setting, read once by a caller that builds many rows (a read of
    the settings costs as much as the rest of this function)."""
    if store_observed is None:
        store_observed = settings.REACH_STORE_OBSERVED_PAYLOADS
    keep = direction != Direction.OBSERVED or store_observed
    deadline = None
    if direction == Direction.OBSERVED and env.message_type == protocol.MessageType.TASK_REQUEST:
        # Traffic between other nodes gets an outcome too: the answers seen on the bus move
        # it, and its deadline ends it EXPIRED when none came (messages/sweeps.py).
        deadline = now + timedelta(milliseconds=min(env.timeout_ms or DEFAULT_TIMEOUT_MS,
                                                    MAX_TIMEOUT_MS))
    return ReceivedRow(
        message_id=env.message_id, task_id=(env.task_id or "")[:200],
        idempotency_key=env.idempotency_key[:200], message_type=env.message_type.value,
        direction=direction, status=Status.RECV if direction == Direction.RECV else Status.OBSERVED,
        from_agent_id=(env.from_agent_id or "")[:265], to_agent_id=(env.to_agent_id or "")[:265],
        target_node_id=(env.target_node_id or "")[:128],
        origin_node_id=(env.origin_node_id or "")[:128],
        reply_node_id=(env.reply_node_id or "")[:128],
        conversation_id=(env.conversation_id or "")[:200],
        scene_group_id=(env.scene_group_id or "")[:200], session_id=(env.session_id or "")[:200],
        topic=topic[:300], headers=env.headers, payload=env.payload if keep else None,
        wire_payload=env.payload, attempt=env.attempt,
        # The message this one answers: a response's inReplyTo, an ACK/NACK/BUSY's ackFor.
        in_reply_to=(env.in_reply_to or env.ack_for or "")[:200], created_at=now,
        updated_at=now, deadline_at=deadline,
    )


def row_log_fields(row: Any) -> dict[str, str]:
    """`extra=` for a log line about this row (a model instance or a ReceivedRow)."""
    return log_fields(message_id=row.message_id, task_id=row.task_id or "",
                      agent=row.to_agent_id or "", node=row.target_node_id or "")


def message_fields(row: Any) -> dict[str, Any]:
    """What a person or a client is shown of any row: the fields the API's message and the
    `a2a_message` event share (a model instance or a ReceivedRow)."""
    return {
        "messageId": row.message_id, "taskId": row.task_id or None,
        "messageType": row.message_type, "direction": row.direction, "status": row.status,
        "error": row.error or None, "attempt": row.attempt,
        "fromAgentId": row.from_agent_id or None, "toAgentId": row.to_agent_id or None,
        "targetNodeId": row.target_node_id or None,
        "conversationId": row.conversation_id or None,
        "sceneGroupId": row.scene_group_id or None, "sessionId": row.session_id or None,
    }


# --- a batch of rows as one JSON document ----------------------------------------------------
_ENCODER = msgspec.json.Encoder()


def json_text(value: Any) -> str:
    """JSON text for one statement parameter: a batch of rows that PostgreSQL takes apart
    with `json_to_recordset` (messages/state.py's insert, messages/ledger.py's tasks and
    numbers).

    msgspec's encoder, in C: json.dumps of these documents was a fifth of the bridge's ingest
    time. Text is written as UTF-8, not as \\u escapes (an emoji escaped takes three times
    the space). Times go as RFC 3339: the console's are in UTC (`Z`), which PostgreSQL reads
    as json.dumps's `+00:00`. msgspec writes a few things json.dumps refused (NaN as null, a
    Decimal or UUID as a string); none reaches a row: the decoder and the API refuse NaN,
    and no column holds the others. What msgspec cannot encode (text that is not Unicode,
    which the decoder and the API also refuse first) goes through the standard library and
    fails there, as before."""
    try:
        return _ENCODER.encode(value).decode()
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=_iso)


def _iso(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
