"""The A2A-over-MQTT profile's traffic, observed (PROTOCOL.md, "The A2A-over-MQTT profile"):
its requests, replies and events on `$a2a/v1/{request,reply,event}/…` become rows and tasks
like the native dialect's, and a live check of the profile's rules.

- A request (`SendMessage`, `SendStreamingMessage`; `CancelTask` as a CANCEL) is an OBSERVED
  row. Its message id is made of where its replies go and how they are told apart, the
  Response Topic and the Correlation Data (`request_key`): each attempt of a requester has
  its own, as the profile requires, so each is a row, and all of them one task (the
  profile's `Task.id`, `params.message.taskId`). The JSON-RPC id, method, Response Topic
  and Correlation Data are kept in its headers.
- A reply is a row answering the request its topic and Correlation Data name: a status of
  SUBMITTED, WORKING, INPUT_REQUIRED or AUTH_REQUIRED acknowledges it (ACKED; each later one
  moves its deadline on by the stream's idle timeout), an artifact is recorded on its
  trace, COMPLETED completes it, FAILED and REJECTED end it TASK_ERROR, CANCELED ends it
  CANCELED, a JSON-RPC error ends it TASK_ERROR (BUSY for -32004
  `responder_unavailable`, EXPIRED for -32003 `request_expired`).
- Nothing by the first-reply timeout (REACH_A2A_FIRST_REPLY_MS, the profile's 15 s) ends a
  request EXPIRED, as the delivery sweep ends the native dialect's observed requests.
- What breaks the profile is flagged on the row (`headers.violations`) and counted
  (`reach_profile_violations_total{rule}`): a request without Response Topic or Correlation
  Data, Correlation Data used again by another task, a retained request, a pooled reply
  without `a2a-responder-agent-id`, a bearer token echoed back.

A request's payload is not stored (REACH_STORE_OBSERVED_PAYLOADS), nor is any token: the
`a2a-authorization` property is never kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction

from messages.events import events_on_commit, message_events
from messages.ledger import Ledger
from messages.models import Change, Direction, Heard, Message, Status
from messages.protocol import MessageType
from messages.rows import ReceivedRow
from messages.state import changes_apply, messages_insert_new
from roster.models import PROFILE_NODE_ID

log = logging.getLogger(__name__)
MT = MessageType
DIALECT = "a2a-mqtt"
AUTH_PROPERTY, RESPONDER_PROPERTY = "a2a-authorization", "a2a-responder-agent-id"
REQUEST_METHODS = {"SendMessage": MT.TASK_REQUEST, "SendStreamingMessage": MT.TASK_REQUEST,
                   "message/send": MT.TASK_REQUEST, "message/stream": MT.TASK_REQUEST,
                   "CancelTask": MT.CANCEL, "tasks/cancel": MT.CANCEL}
WORKING_STATES = {"TASK_STATE_SUBMITTED", "TASK_STATE_WORKING", "TASK_STATE_INPUT_REQUIRED",
                  "TASK_STATE_AUTH_REQUIRED"}
FINAL_STATES = {"TASK_STATE_COMPLETED": Status.COMPLETED, "TASK_STATE_FAILED": Status.TASK_ERROR,
                "TASK_STATE_REJECTED": Status.TASK_ERROR, "TASK_STATE_CANCELED": Status.CANCELED}


@dataclass(frozen=True, slots=True)
class ProfileFrame:
    """One message of the profile's request, reply or event tree, as the bridge heard it."""
    topic: str
    payload: bytes
    user: tuple[tuple[str, str], ...] = ()
    response_topic: str = ""
    correlation: bytes = b""
    retain: bool = False


def request_key(response_topic: str, correlation: bytes) -> str:
    """The message id of a request: what its replies name it by."""
    digest = hashlib.sha256(response_topic.encode() + b"\0" + correlation).hexdigest()
    return f"a2a-{digest[:40]}"


@dataclass
class _Batch:
    now: datetime
    rows: list[ReceivedRow] = field(default_factory=list)
    changes: dict[int, Change] = field(default_factory=dict)  # id(row) → what it moves
    working: dict[int, str] = field(default_factory=dict)  # id(row) → the request it goes on
    counts: Counter = field(default_factory=Counter)


def _violation(batch: _Batch, headers: dict, rule: str, topic: str) -> None:
    """Flag it on its row; counted once the row is stored (every bridge hears every frame,
    one stores it)."""
    headers.setdefault("violations", []).append(rule)


def _read(payload: bytes) -> dict | None:
    try:
        doc = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _row(batch: _Batch, *, message_id: str, message_type: str, topic: str, headers: dict,
         task_id: str = "", from_agent: str = "", to_agent: str = "", conversation: str = "",
         in_reply_to: str = "", deadline: datetime | None = None) -> ReceivedRow:
    now = batch.now
    return ReceivedRow(
        message_id=message_id[:200], task_id=task_id[:200], idempotency_key="",
        message_type=message_type, direction=Direction.OBSERVED, status=Status.OBSERVED,
        from_agent_id=from_agent[:265], to_agent_id=to_agent[:265],
        target_node_id=PROFILE_NODE_ID, origin_node_id=PROFILE_NODE_ID,
        reply_node_id=PROFILE_NODE_ID, conversation_id=conversation[:200],
        scene_group_id="", session_id="", topic=topic[:300], headers=headers, payload=None,
        attempt=1, in_reply_to=in_reply_to[:200], created_at=now, updated_at=now,
        deadline_at=deadline)


def _agent_of(topic: str, tree: str) -> str:
    """`{org}/{unit}/{agent}` (or `{org}/{unit}/pool/{pool}`) of a profile topic."""
    rest = topic[len(f"{settings.REACH_A2A_ROOT}/{tree}/"):].split("/")
    if tree == "request" and len(rest) == 4 and rest[2] == "pool":
        return "/".join(rest)
    return "/".join(rest[:3]) if len(rest) >= 3 else ""


def _request(batch: _Batch, frame: ProfileFrame) -> None:
    doc = _read(frame.payload)
    user = dict(frame.user)
    headers: dict[str, Any] = {"dialect": DIALECT}
    method = doc.get("method") if doc else None
    params = doc.get("params") if doc and isinstance(doc.get("params"), dict) else {}
    message = params.get("message") if isinstance(params.get("message"), dict) else {}
    task_id = message.get("taskId") or params.get("id") or ""
    headers.update(method=str(method)[:60] if method else None,
                   jsonrpcId=doc.get("id") if doc else None,
                   responseTopic=frame.response_topic[:300] or None,
                   correlationData=frame.correlation.hex()[:200] or None,
                   timeoutMs=settings.REACH_A2A_FIRST_REPLY_MS)
    to_agent = _agent_of(frame.topic, "request")
    if "/pool/" in frame.topic:
        headers["pool"] = to_agent
    if doc is None:
        batch.counts["rejected:profile_not_json"] += 1
        return
    if not frame.response_topic:
        _violation(batch, headers, "no_response_topic", frame.topic)
    if not frame.correlation:
        _violation(batch, headers, "no_correlation_data", frame.topic)
    if frame.retain:
        _violation(batch, headers, "retained_request", frame.topic)
    if AUTH_PROPERTY in user:
        headers["bearer"] = True  # that it carried one, never the token
    # The requester's id, when it follows the profile's reply topics.
    reply_prefix = f"{settings.REACH_A2A_ROOT}/reply/"
    requester = ("/".join(frame.response_topic[len(reply_prefix):].split("/")[:3])
                 if frame.response_topic.startswith(reply_prefix) else "")
    kind = REQUEST_METHODS.get(str(method), MT.EVENT)
    key = (request_key(frame.response_topic, frame.correlation)
           if frame.response_topic and frame.correlation
           else f"a2a-{hashlib.sha256(frame.topic.encode() + frame.payload).hexdigest()[:40]}")
    deadline = None
    if kind == MT.TASK_REQUEST and frame.response_topic and frame.correlation:
        deadline = batch.now + timedelta(milliseconds=settings.REACH_A2A_FIRST_REPLY_MS)
    batch.rows.append(_row(batch, message_id=key, message_type=kind, topic=frame.topic,
                           headers=headers, task_id=str(task_id), from_agent=requester,
                           to_agent=to_agent, conversation=str(message.get("contextId") or ""),
                           deadline=deadline))


def _reply(batch: _Batch, frame: ProfileFrame) -> None:
    doc = _read(frame.payload)
    user = dict(frame.user)
    if doc is None:
        batch.counts["rejected:profile_not_json"] += 1
        return
    key = request_key(frame.topic, frame.correlation)
    headers: dict[str, Any] = {"dialect": DIALECT, "jsonrpcId": doc.get("id"),
                               "correlationData": frame.correlation.hex()[:200] or None}
    responder = user.get(RESPONDER_PROPERTY, "")
    if responder:
        headers["responder"] = responder[:265]
    if AUTH_PROPERTY in user:
        _violation(batch, headers, "token_echoed", frame.topic)
    if not frame.correlation:
        _violation(batch, headers, "no_correlation_data", frame.topic)
    kind, change, words = _reply_meaning(doc, now=batch.now)
    headers["reply"] = words
    reply_id = f"{key}-{hashlib.sha256(frame.payload).hexdigest()[:16]}"
    row = _row(batch, message_id=reply_id, message_type=kind, topic=frame.topic,
               headers=headers, task_id=_task_of(doc), from_agent=responder,
               in_reply_to=key)
    batch.rows.append(row)
    if change is not None:
        change.message_id = key
        change.heard = Heard(origin_node_id=PROFILE_NODE_ID, heard_on=PROFILE_NODE_ID,
                             direction=Direction.OBSERVED)
        batch.changes[id(row)] = change
    if kind == MT.ACK:
        batch.working[id(row)] = key


def _task_of(doc: dict) -> str:
    result = doc.get("result") if isinstance(doc.get("result"), dict) else {}
    for part in ("statusUpdate", "artifactUpdate"):
        if isinstance(result.get(part), dict):
            return str(result[part].get("taskId") or "")
    if isinstance(result.get("task"), dict):
        return str(result["task"].get("id") or "")
    return ""


def _reply_meaning(doc: dict, *, now: datetime) -> tuple[str, Change | None, str]:
    """(the row's type, the change it makes to its request or None, words for its trace)."""
    error = doc.get("error")
    if isinstance(error, dict):
        code, message = error.get("code"), str(error.get("message") or "")[:500]
        data = error.get("data") if isinstance(error.get("data"), dict) else {}
        kind = data.get("a2a_error")
        words = f"JSON-RPC error {code}: {message}"
        if code == -32004 and kind == "responder_unavailable":
            return MT.BUSY, Change(to=Status.BUSY, reason="BUSY (-32004 responder_unavailable)",
                                   actor="bridge", fields={"error": words}), words
        if code == -32003 and kind == "request_expired":
            return MT.NACK, Change(to=Status.EXPIRED, reason="-32003 request_expired",
                                   actor="bridge", allowed=frozenset({Status.OBSERVED,
                                                                      Status.ACKED}),
                                   fields={"error": words, "finished_at": now}), words
        return MT.TASK_RESPONSE, Change(to=Status.TASK_ERROR, reason="JSON-RPC error",
                                        actor="bridge",
                                        fields={"error": words, "finished_at": now}), words
    result = doc.get("result") if isinstance(doc.get("result"), dict) else {}
    if isinstance(result.get("artifactUpdate"), dict):
        artifact = result["artifactUpdate"].get("artifact") or {}
        return MT.EVENT, None, f"artifact {str(artifact.get('artifactId', ''))[:80]}"
    state = ""
    if isinstance(result.get("statusUpdate"), dict):
        status = result["statusUpdate"].get("status") or {}
        state = str(status.get("state") or "") if isinstance(status, dict) else ""
    elif isinstance(result.get("task"), dict):
        status = result["task"].get("status") or {}
        state = str(status.get("state") or "") if isinstance(status, dict) else ""
    elif isinstance(result.get("message"), dict):
        state = "TASK_STATE_COMPLETED"  # a plain message answers the request whole
    if state in WORKING_STATES:
        idle = timedelta(milliseconds=settings.REACH_A2A_STREAM_IDLE_MS)
        return MT.ACK, Change(to=Status.ACKED, reason=state, actor="bridge",
                              fields={"acked_at": now, "ack_deadline_at": None,
                                      "deadline_at": now + idle}), state
    if state in FINAL_STATES:
        to = FINAL_STATES[state]
        error = "" if to == Status.COMPLETED else f"the responder said {state}"
        if to == Status.CANCELED:
            # From ACKED (a task is canceled once it was taken up): the state machine takes
            # an observed request to CANCELED from there only.
            return MT.TASK_RESPONSE, Change(
                to=Status.CANCELED, reason=state, actor="bridge",
                fields={"finished_at": now, "error": "canceled by the responder"}), state
        return MT.TASK_RESPONSE, Change(to=to, reason=state, actor="bridge",
                                        fields={"finished_at": now, "error": error,
                                                "ack_deadline_at": None}), state
    return MT.EVENT, None, state or "a reply the console cannot read"


def _event(batch: _Batch, frame: ProfileFrame) -> None:
    headers = {"dialect": DIALECT}
    agent = _agent_of(frame.topic, "event")
    digest = hashlib.sha256(frame.topic.encode() + frame.payload).hexdigest()[:40]
    batch.rows.append(_row(batch, message_id=f"a2a-e{digest}", message_type=MT.EVENT,
                           topic=frame.topic, headers=headers, from_agent=agent))


_last_logged: dict[str, float] = {}


def _log_once_a_minute(rule: str, topic: str) -> None:
    now = time.monotonic()
    if now - _last_logged.get(rule, -120.0) >= 60.0:
        _last_logged[rule] = now
        log.warning("A2A-over-MQTT traffic breaks the profile (%s) on %s", rule, topic[:200])


def profile_traffic_ingest(frames: list[ProfileFrame], *, now: datetime) -> Counter:
    """One transaction for the frames of one bridge batch: their rows stored once each,
    then the changes of the replies this call stored, then tasks, numbers and events."""
    batch = _Batch(now=now)
    root = settings.REACH_A2A_ROOT
    for frame in frames:
        tree = frame.topic[len(root) + 1:].split("/", 1)[0]
        if tree == "request":
            _request(batch, frame)
        elif tree == "reply":
            _reply(batch, frame)
        elif tree == "event":
            _event(batch, frame)
    _pooled_replies_check(batch)
    if not batch.rows:
        return batch.counts
    ledger = Ledger()
    with transaction.atomic():
        _correlation_reused(batch)
        fresh = messages_insert_new(batch.rows, ledger=ledger)
        batch.counts["stored"] += len(fresh)
        inserted = {id(row) for row in fresh}
        changes = [c for row_id, c in batch.changes.items() if row_id in inserted]
        applied = changes_apply(changes, now=now, ledger=ledger)
        batch.counts["stale_answers"] += applied.skipped
        working = {key for row_id, key in batch.working.items() if row_id in inserted}
        if working:
            # Each later item of a stream moves an acknowledged request's deadline on.
            Message.objects.filter(message_id__in=working, status=Status.ACKED,
                                   direction=Direction.OBSERVED).update(
                deadline_at=now + timedelta(milliseconds=settings.REACH_A2A_STREAM_IDLE_MS))
        ledger.write()
        events: list[dict] = []
        for row in fresh:
            events += message_events(row, previous="")
        events += applied.events
        events_on_commit(events)
    for row in fresh:
        for rule in row.headers.get("violations", ()):
            batch.counts[f"profile_violations:{rule}"] += 1
            _log_once_a_minute(rule, row.topic)
    return batch.counts


def _pooled_replies_check(batch: _Batch) -> None:
    """A reply to a pooled request must name its responder (`a2a-responder-agent-id`)."""
    pooled = {r.message_id for r in batch.rows if (r.headers or {}).get("pool")}
    keys = {r.in_reply_to for r in batch.rows if r.in_reply_to and "responder" not in r.headers}
    if not keys:
        return
    known = pooled | set(Message.objects.filter(
        message_id__in=keys - pooled, headers__pool__isnull=False).values_list(
        "message_id", flat=True)) if keys - pooled else pooled
    for row in batch.rows:
        if row.in_reply_to in known and "responder" not in row.headers:
            _violation(batch, row.headers, "pooled_reply_without_responder", row.topic)


def _correlation_reused(batch: _Batch) -> None:
    """Correlation Data used again on the same reply topic by another task: the first
    request keeps its row; the second is stored under a key of its own and flagged."""
    requests = [r for r in batch.rows if r.message_type in (MT.TASK_REQUEST, MT.CANCEL)
                and r.message_id.startswith("a2a-") and not r.in_reply_to]
    if not requests:
        return
    stored = dict(Message.objects.filter(message_id__in=[r.message_id for r in requests])
                  .values_list("message_id", "task_id"))
    seen: dict[str, str] = {}
    for row in requests:
        earlier = stored.get(row.message_id, seen.get(row.message_id))
        if earlier is not None and earlier != row.task_id:
            _violation(batch, row.headers, "correlation_reused", row.topic)
            suffix = hashlib.sha256(row.task_id.encode()).hexdigest()[:8]
            row.message_id = f"{row.message_id}-{suffix}"
            row.deadline_at = None  # its replies cannot be told from the first one's
        seen.setdefault(row.message_id, row.task_id)
