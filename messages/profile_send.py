"""The console as a requester of the A2A-over-MQTT profile (PROTOCOL.md, "The A2A-over-MQTT
profile"): a send to `{org}/{unit}/{agent}`, or a capability routed to such an agent, is the
same TASK_REQUEST row as a native send (outbox, retries, backpressure, storm guard, resend,
cancel, audit), shaped here for the profile's wire:

- Its message id is made of where its replies go and how they are told apart
  (messages/profile_traffic.py `request_key`: the console's Response Topic and a fresh
  Correlation Data per row). Each attempt is a row of its own, so each has its own
  Correlation Data, as the profile requires; the bridges, which hear the request tree in
  monitor mode, find the row already stored when they hear it go by, and the replies on the
  console's Response Topic move it as they move an observed request.
- Its bytes are a JSON-RPC `SendMessage` (a `CancelTask` for a cancel), published with the
  Response Topic and Correlation Data as MQTT 5 properties (`publish_properties`).
- Its timing is the profile's requester timing: a first reply within
  REACH_A2A_FIRST_REPLY_MS or another attempt, at most REACH_A2A_MAX_ATTEMPTS, after
  REACH_A2A_BACKOFF_MS with ±REACH_A2A_JITTER (messages/delivery.py reads them for rows of
  this dialect).
- Its answer, for `wait: true` and the API, is the task as the profile delivered it: the
  final reply's result, with the artifacts streamed before it (`profile_response`).
- A pool (`{org}/{unit}/pool/{pool}`) is sent to on its shared request topic; the member that
  answered names itself (`a2a-responder-agent-id`), and what follows for that task (another
  send of it, a retry, a resend, CancelTask) goes to that member's own request topic, as the
  profile says (`pool_resolution`, `task_responder`).
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings

from directory.resolver import NOT_DELIVERABLE, Candidate, Resolution
from messages.models import Direction, Message, Status
from messages.profile_traffic import DIALECT, RESPONDER_PROPERTY, console_reply_topic, request_key
from messages.protocol import MessageType, PayloadTooLarge, profile_request_topic
from roster.ids import PROFILE_ID_RE, profile_agent_id, profile_pool_id
from roster.models import PROFILE_NODE_ID

MT = MessageType




def is_profile_row(row: Message) -> bool:
    return (row.headers or {}).get("dialect") == DIALECT


def _shape(row: Message, *, method: str) -> None:
    """The profile's addressing on a row of ours: a fresh Correlation Data, the message id
    its replies will name, the request topic, and what a trace shows of both."""
    correlation = uuid.uuid4().hex
    topic = console_reply_topic()
    row.message_id = request_key(topic, correlation.encode())
    row.topic = profile_request_topic(settings.REACH_A2A_ROOT, row.to_agent_id)
    pool = {"pool": row.to_agent_id} if profile_pool_id(row.to_agent_id) else {}
    row.headers = {**(row.headers or {}), **pool, "dialect": DIALECT, "method": method,
                   "jsonrpcId": row.message_id, "responseTopic": topic,
                   "correlationData": correlation.encode().hex(),
                   "idleMs": settings.REACH_A2A_STREAM_IDLE_MS}


def profile_request_shape(row: Message, *, timeout_given: bool, now: datetime) -> None:
    """Make an unsaved TASK_REQUEST row of ours a profile `SendMessage` (routed to a
    profile agent). Without a timeoutMs of the caller's, the task gets the profile's whole
    requester budget (REACH_A2A_TIMEOUT_MS): every attempt's first-reply wait and backoff.
    Raises as `profile_encode` does when it cannot go on the wire."""
    _shape(row, method="SendMessage")
    if not timeout_given:
        row.headers["timeoutMs"] = settings.REACH_A2A_TIMEOUT_MS
        row.deadline_at = now + timedelta(milliseconds=settings.REACH_A2A_TIMEOUT_MS)
    profile_encode(row)


def task_responder(*, task_id: str, pool: str) -> str | None:
    """The member of `pool` that answered the console's requests of `task_id` last (its
    replies' `a2a-responder-agent-id`), as `{org}/{unit}/{agent}`; None before any named
    itself."""
    if not task_id:
        return None
    # By the console's own requests of the task: a pool's member may give the task an id of
    # its own in its replies.
    asked = list(Message.objects.filter(task_id=task_id, direction=Direction.SEND,
                                        message_type=MT.TASK_REQUEST,
                                        resolution__target=pool)
                 .order_by("-id").values_list("message_id", flat=True)[:100])
    if not asked:
        return None
    last = (Message.objects.filter(in_reply_to__in=asked, direction=Direction.RECV,
                                   headers__has_key="responder")
            .order_by("-id").values_list("headers", flat=True).first())
    value = str((last or {}).get("responder", ""))
    org, unit = pool.split("/")[:2]
    if profile_agent_id(value):
        # A member of the pool is of its org and unit: another is not followed.
        return value if value.startswith(f"{org}/{unit}/") else None
    if PROFILE_ID_RE.fullmatch(value):  # the profile's value: the member's own agent id
        return f"{org}/{unit}/{value}"
    return None


def pool_resolution(*, pool_id: str, task_id: str | None) -> Resolution:
    """Where a send to a pool goes: the member that answered this task before (follow-ups
    are the profile's direct traffic), else the pool's shared topic, whose members the
    console cannot know (a pool no member listens to is silence: the first-reply timeout
    and the retries end it, with words)."""
    if not settings.REACH_A2A_PROFILE:
        return Resolution(None, None, "pool", f"{pool_id} is a pool of the A2A-over-MQTT "
                          "profile, which this console does not speak now "
                          "(REACH_A2A_PROFILE=0): nothing would hear its replies",
                          outcome=NOT_DELIVERABLE)
    org = pool_id.split("/", 1)[0]
    responder = task_responder(task_id=task_id or "", pool=pool_id)
    if responder:
        why = (f"answered task {task_id} for {pool_id} ({RESPONDER_PROPERTY}): the "
               "task's follow-ups go to it")
        return Resolution(responder, PROFILE_NODE_ID, "pool", f"{pool_id} → {responder}",
                          [Candidate(responder, PROFILE_NODE_ID, "ONLINE", True, why, org,
                                     chosen=True)])
    return Resolution(pool_id, PROFILE_NODE_ID, "pool",
                      f"pool {pool_id}: the broker hands the request to one member")


def profile_cancel_row(*, request: Message, now: datetime) -> Message:
    """The `CancelTask` that tells a profile agent a task of ours is canceled: published to
    its request topic like a request (to a pool's member that answered the task, when one
    did), with a Correlation Data of its own (its reply is recorded on the trace and moves
    nothing)."""
    pool = profile_pool_id(request.to_agent_id)
    to = (task_responder(task_id=request.task_id, pool=pool) if pool else None) or (
        request.to_agent_id)
    row = Message(
        task_id=request.task_id, idempotency_key="", message_type=MT.CANCEL,
        direction=Direction.SEND, status=Status.SENT,
        from_agent_id=request.from_agent_id, to_agent_id=to,
        target_node_id=request.target_node_id, origin_node_id=request.origin_node_id,
        reply_node_id=request.reply_node_id, conversation_id=request.conversation_id,
        headers={"cancelFor": request.task_id}, payload={"id": request.task_id},
        created_at=now, updated_at=now, publish_at=now,
        deadline_at=now + timedelta(seconds=settings.REACH_IDEMPOTENCY_TTL_S))
    _shape(row, method="CancelTask")
    return row


def _part(payload: Any) -> dict:
    """The send's payload as one A2A part: `{"text": …}` a text part, anything else a data
    part (PROTOCOL.md)."""
    if isinstance(payload, dict) and set(payload) == {"text"} and isinstance(payload["text"],
                                                                            str):
        return {"text": payload["text"]}
    return {"data": payload}


def profile_encode(row: Message) -> bytes:
    """The JSON-RPC bytes of a profile row of ours. Raises PayloadTooLarge over
    REACH_MAX_MESSAGE_BYTES, ValueError/TypeError for a payload that is not JSON."""
    headers = row.headers or {}
    if row.message_type == MT.CANCEL:
        params: dict[str, Any] = {"id": row.task_id}
    else:
        message: dict[str, Any] = {"messageId": row.message_id, "role": "ROLE_USER",
                                   "parts": [_part(row.payload)], "taskId": row.task_id}
        if row.conversation_id:
            message["contextId"] = row.conversation_id
        params = {"message": message,
                  "metadata": {"sender": row.from_agent_id,
                               "idempotencyKey": row.idempotency_key}}
    data = json.dumps({"jsonrpc": "2.0", "id": headers.get("jsonrpcId") or row.message_id,
                       "method": headers.get("method", "SendMessage"), "params": params},
                      separators=(",", ":"), allow_nan=False).encode()
    limit = settings.REACH_MAX_MESSAGE_BYTES
    if len(data) > limit:
        raise PayloadTooLarge(f"the JSON-RPC request is {len(data)} bytes; the limit is "
                              f"{limit} (REACH_MAX_MESSAGE_BYTES)")
    return data


def publish_properties(row: Message) -> tuple[str, bytes] | None:
    """(Response Topic, Correlation Data) a profile row of ours is published with; None for
    a native row."""
    headers = row.headers or {}
    if headers.get("dialect") != DIALECT:
        return None
    return headers["responseTopic"], bytes.fromhex(headers["correlationData"])


def profile_response(row: Message) -> dict | None:
    """The task as the profile delivered it to the request `row` of ours: the final reply's
    `result` (or `error`), with the artifacts streamed before it in `result.task.artifacts`
    when the reply was a status update. None when no final reply is stored."""
    replies = list(Message.objects.filter(in_reply_to=row.message_id,
                                          direction=Direction.RECV)
                   .order_by("created_at", "id").values_list("message_type", "payload"))
    # A final state or a JSON-RPC error (BUSY and NACK rows are the profile's -32004 and
    # -32003: messages/profile_traffic.py).
    final = next((p for kind, p in reversed(replies) if kind in (
        MT.TASK_RESPONSE, MT.BUSY, MT.NACK) and isinstance(p, dict)), None)
    if final is None:
        return None
    if "error" in final:
        return {"error": final["error"]}
    result = final.get("result") if isinstance(final.get("result"), dict) else {}
    streamed = [p["result"]["artifactUpdate"].get("artifact") for kind, p in replies
                if isinstance(p, dict) and isinstance(p.get("result"), dict)
                and isinstance(p["result"].get("artifactUpdate"), dict)]
    if "message" in result:
        return {"result": result, "artifacts": streamed} if streamed else {"result": result}
    if isinstance(result.get("task"), dict):
        task = dict(result["task"])
        if streamed and not task.get("artifacts"):
            task["artifacts"] = streamed
        return {"result": {"task": task}}
    update = result.get("statusUpdate") if isinstance(result.get("statusUpdate"), dict) else {}
    return {"result": {"task": {"id": update.get("taskId") or row.task_id,
                                "contextId": update.get("contextId", ""),
                                "status": update.get("status"), "artifacts": streamed}}}
