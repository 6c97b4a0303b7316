"""The A2A-over-MQTT profile's traffic, observed (PROTOCOL.md, "The A2A-over-MQTT profile"):
its requests, replies and events on `$a2a/v1/{request,reply,event}/…` become rows and tasks
like the native dialect's, and a live check of the profile's rules.

- A request (`SendMessage`, `SendStreamingMessage`; `CancelTask` as a CANCEL, any other
  method an EVENT) is an OBSERVED row. Its message id is made of where its replies go and
  how they are told apart, the Response Topic and the Correlation Data (`request_key`):
  each attempt of a requester has its own, as the profile requires, so each is a row,
  numbered, and all of them one task (the profile's `Task.id`). The JSON-RPC id, method,
  Response Topic and Correlation Data are kept in its headers. Correlation Data used again
  later on the same reply topic (the first request ended) gets a key of its own, made of
  its task too, and the replies that name that task find it (`_targets`); used again while
  the first is open, it is flagged.
- A reply is a row answering the TASK_REQUEST its topic and Correlation Data name (in the
  order heard; `headers.moves` says what it does, so a reply stored before its request,
  by another bridge or in an earlier batch, still moves it once the request is stored):
  SUBMITTED or WORKING acknowledge it (each later item moves its deadline on by the
  stream's idle timeout), INPUT_REQUIRED or AUTH_REQUIRED, or a task answered whole while
  WORKING, acknowledge it and end that request's stream (no deadline: the task goes on
  with another request), an artifact is recorded on its trace, COMPLETED completes it,
  FAILED and REJECTED end it TASK_ERROR, CANCELED ends it CANCELED, a JSON-RPC error
  TASK_ERROR (BUSY for -32004 `responder_unavailable`, EXPIRED for -32003
  `request_expired`).
- Nothing by the first-reply timeout (REACH_A2A_FIRST_REPLY_MS, the profile's 15 s) ends a
  request EXPIRED, as the delivery sweep ends the native dialect's observed requests.
- What breaks the profile is flagged on the row (`headers.violations`) and counted once
  the row is stored (`reach_profile_violations_total{rule}`).

The console's own requests (messages/profile_send.py) are rows of the same keys: their echo
on the request tree is the row already stored, and the replies on the console's Response
Topic are RECV rows, kept whole, that move them (`ours`); one to an attempt the console has
retried moves that attempt's retry under way.

A frame over REACH_MAX_MESSAGE_BYTES, not JSON, or of a shape the console cannot read is
counted and skipped; what a row keeps of a frame is cut to a few hundred characters. A
request's payload is not stored (REACH_STORE_OBSERVED_PAYLOADS), nor is any token: the
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
from django.db.models import Count

from messages.backpressure import held_release
from messages.events import events_on_commit, message_events
from messages.ledger import Ledger
from messages.models import Change, Direction, Heard, Message, Status
from messages.outbox import outbox_wake
from messages.protocol import MessageType
from messages.rows import ReceivedRow
from messages.state import changes_apply, messages_insert_new
from roster.models import PROFILE_NODE_ID, Dialect

log = logging.getLogger(__name__)
MT = MessageType
DIALECT = Dialect.A2A_MQTT.value
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


def console_reply_topic() -> str:
    """The console's own Response Topic (messages/profile_send.py): the replies heard on it
    answer the console's requests, and the console keeps them whole."""
    return f"{settings.REACH_A2A_ROOT}/reply/{settings.REACH_A2A_REQUESTER}/replies"


def request_key(response_topic: str, correlation: bytes) -> str:
    """The message id of a request: what its replies name it by."""
    digest = hashlib.sha256(response_topic.encode() + b"\0" + correlation).hexdigest()
    return f"a2a-{digest[:40]}"


@dataclass(frozen=True, slots=True)
class Move:
    """What a reply does to its request: kept in the reply's headers (`moves`), so that it
    can be done later, when the request is stored after it."""
    to: str
    reason: str
    error: str = ""
    # ACKED only: "idle" (the stream goes on: its deadline moves on) or "none" (the stream
    # for this request ended: no deadline).
    deadline: str = ""

    def as_header(self) -> dict[str, str]:
        return {"to": self.to, "reason": self.reason, "error": self.error,
                "deadline": self.deadline}


def _changes(key: str, moves: list[Move], *, now: datetime, ours: bool = False
             ) -> list[Change]:
    """`ours`: replies on the console's own Response Topic, which move its own requests
    (received, as a native answer on its inbox is). Those keep their task's deadline
    (timeoutMs) through a stream; an observed request's moves on with each item."""
    heard = Heard(origin_node_id=PROFILE_NODE_ID, heard_on=PROFILE_NODE_ID,
                  direction=Direction.RECV if ours else Direction.OBSERVED)
    idle = timedelta(milliseconds=settings.REACH_A2A_STREAM_IDLE_MS)
    out = []
    for move in moves:
        if move.to == Status.ACKED:
            fields = {"acked_at": now, "ack_deadline_at": None}
            if not ours:
                fields["deadline_at"] = now + idle if move.deadline == "idle" else None
        else:
            fields = {"error": move.error, "finished_at": now, "ack_deadline_at": None}
            if move.to == Status.BUSY and not ours:
                fields = {"error": move.error}
        out.append(Change(to=move.to, reason=move.reason[:200], actor="bridge",
                          message_id=key, fields=fields, heard=heard))
    return out


@dataclass
class _Batch:
    now: datetime
    rows: list[ReceivedRow] = field(default_factory=list)
    # id(reply row) → (the request key its topic and Correlation Data name, the task it
    # names or "", what it does, whether it came on the console's own Response Topic)
    replies: dict[int, tuple[str, str, list[Move], bool]] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)


def _violation(headers: dict, rule: str) -> None:
    """Flag it on its row; counted once the row is stored (every bridge hears every frame,
    one stores it)."""
    headers.setdefault("violations", []).append(rule)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _read(payload: bytes) -> dict | None:
    try:
        doc = json.loads(payload, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _short(value: Any, limit: int = 200) -> str | int | None:
    """A scalar kept as it is when short (a JSON-RPC id, a code), else cut or left out."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value if abs(value) < 10 ** 18 else None
    if isinstance(value, str):
        return value[:limit]
    return None


def _row(batch: _Batch, *, message_id: str, message_type: str, topic: str, headers: dict,
         task_id: str = "", from_agent: str = "", to_agent: str = "", conversation: str = "",
         in_reply_to: str = "", deadline: datetime | None = None, payload: Any = None,
         ours: bool = False) -> ReceivedRow:
    now = batch.now
    return ReceivedRow(
        message_id=message_id[:200], task_id=task_id[:200], idempotency_key="",
        message_type=message_type, direction=Direction.RECV if ours else Direction.OBSERVED,
        status=Status.RECV if ours else Status.OBSERVED,
        from_agent_id=from_agent[:265], to_agent_id=to_agent[:265],
        target_node_id=PROFILE_NODE_ID, origin_node_id=PROFILE_NODE_ID,
        reply_node_id=PROFILE_NODE_ID, conversation_id=conversation[:200],
        scene_group_id="", session_id="", topic=topic[:300], headers=headers, payload=payload,
        attempt=1, in_reply_to=in_reply_to[:200], created_at=now, updated_at=now,
        deadline_at=deadline)


def _agent_of(topic: str, tree: str) -> str:
    """`{org}/{unit}/{agent}` (or `{org}/{unit}/pool/{pool}`) of a profile topic."""
    rest = topic[len(f"{settings.REACH_A2A_ROOT}/{tree}/"):].split("/")
    if tree == "request" and len(rest) == 4 and rest[2] == "pool":
        return "/".join(rest)
    return "/".join(rest[:3]) if len(rest) >= 3 else ""


def _request(batch: _Batch, frame: ProfileFrame, doc: dict) -> None:
    user = dict(frame.user)
    method = _short(doc.get("method"), 60)
    params = _dict(doc.get("params"))
    message = _dict(params.get("message"))
    task_id = _short(message.get("taskId") or params.get("id")) or ""
    headers: dict[str, Any] = {
        "dialect": DIALECT, "method": method, "jsonrpcId": _short(doc.get("id")),
        "responseTopic": frame.response_topic[:300] or None,
        "correlationData": frame.correlation.hex()[:200] or None,
        "timeoutMs": settings.REACH_A2A_FIRST_REPLY_MS,
        "idleMs": settings.REACH_A2A_STREAM_IDLE_MS}
    to_agent = _agent_of(frame.topic, "request")
    if "/pool/" in to_agent:
        headers["pool"] = to_agent
    if not frame.response_topic:
        _violation(headers, "no_response_topic")
    if not frame.correlation:
        _violation(headers, "no_correlation_data")
    if frame.retain:
        _violation(headers, "retained_request")
    if AUTH_PROPERTY in user:
        headers["bearer"] = True  # that it carried one, never the token
    # The requester's id, when it follows the profile's reply topics.
    reply_prefix = f"{settings.REACH_A2A_ROOT}/reply/"
    requester = ("/".join(frame.response_topic[len(reply_prefix):].split("/")[:3])
                 if frame.response_topic.startswith(reply_prefix) else "")
    kind = REQUEST_METHODS.get(str(method), MT.EVENT)
    replyable = bool(frame.response_topic and frame.correlation)
    key = (request_key(frame.response_topic, frame.correlation) if replyable
           else f"a2a-{hashlib.sha256(frame.topic.encode() + frame.payload).hexdigest()[:40]}")
    deadline = None
    if kind == MT.TASK_REQUEST and replyable:
        deadline = batch.now + timedelta(milliseconds=settings.REACH_A2A_FIRST_REPLY_MS)
    batch.rows.append(_row(batch, message_id=key, message_type=kind, topic=frame.topic,
                           headers=headers, task_id=str(task_id), from_agent=requester,
                           to_agent=to_agent,
                           conversation=str(_short(message.get("contextId")) or ""),
                           deadline=deadline))


def _reply(batch: _Batch, frame: ProfileFrame, doc: dict) -> None:
    user = dict(frame.user)
    key = request_key(frame.topic, frame.correlation)
    headers: dict[str, Any] = {"dialect": DIALECT, "jsonrpcId": _short(doc.get("id")),
                               "correlationData": frame.correlation.hex()[:200] or None}
    responder = str(user.get(RESPONDER_PROPERTY, ""))[:265]
    if responder:
        headers["responder"] = responder
    if AUTH_PROPERTY in user:
        _violation(headers, "token_echoed")
    if not frame.correlation:
        _violation(headers, "no_correlation_data")
    kind, moves, words = _reply_meaning(doc)
    headers["reply"] = words
    if moves:
        headers["moves"] = [m.as_header() for m in moves]
    task = _task_of(doc)
    # An answer to the console's own request is kept whole: it is the task's result, which
    # the caller of the send asked for (messages/profile_send.py `profile_response`).
    ours = frame.topic == console_reply_topic()
    # Each frame heard is a row, but a frame heard again (QoS 1, another bridge) is one.
    reply_id = f"{key}-{hashlib.sha256(frame.payload).hexdigest()[:16]}"
    row = _row(batch, message_id=reply_id, message_type=kind, topic=frame.topic,
               headers=headers, task_id=task, from_agent=responder, in_reply_to=key,
               payload=doc if ours else None, ours=ours)
    batch.rows.append(row)
    batch.replies[id(row)] = (key, task, moves, ours)


def _task_of(doc: dict) -> str:
    result = _dict(doc.get("result"))
    for part in ("statusUpdate", "artifactUpdate"):
        if isinstance(result.get(part), dict):
            return str(_short(result[part].get("taskId")) or "")
    if isinstance(result.get("task"), dict):
        return str(_short(result["task"].get("id")) or "")
    return ""


def _state(container: Any) -> str:
    status = _dict(_dict(container).get("status"))
    return str(_short(status.get("state"), 60) or "")


def _reply_meaning(doc: dict) -> tuple[str, list[Move], str]:
    """(the row's type, what it does to its request, words for its trace)."""
    error = doc.get("error")
    if isinstance(error, dict):
        code, message = _short(error.get("code"), 20), str(_short(error.get("message")) or "")
        kind = _dict(error.get("data")).get("a2a_error")
        words = f"JSON-RPC error {code}: {message}"
        if code == -32004 and kind == "responder_unavailable":
            return MT.BUSY, [Move(Status.BUSY, "BUSY (-32004 responder_unavailable)",
                                  words)], words
        if code == -32003 and kind == "request_expired":
            return MT.NACK, [Move(Status.EXPIRED, "-32003 request_expired", words)], words
        return MT.TASK_RESPONSE, [Move(Status.TASK_ERROR, "JSON-RPC error", words)], words
    result = _dict(doc.get("result"))
    if isinstance(result.get("artifactUpdate"), dict):
        artifact = _dict(result["artifactUpdate"].get("artifact"))
        # An item of the stream: the responder has the request (an artifact may come
        # before any status), and the stream goes on.
        return MT.EVENT, [Move(Status.ACKED, "artifact", deadline="idle")], (
            f"artifact {_short(artifact.get('artifactId'), 80) or ''}")
    stream = "idle"
    if isinstance(result.get("statusUpdate"), dict):
        state = _state(result["statusUpdate"])
    elif isinstance(result.get("task"), dict):
        state, stream = _state(result["task"]), "none"  # answered whole: nothing follows
    elif isinstance(result.get("message"), dict):
        state = "TASK_STATE_COMPLETED"  # a plain message answers the request whole
    else:
        state = ""
    if state in WORKING_STATES:
        # The profile ends a request's stream on these two: the task goes on elsewhere.
        if state in ("TASK_STATE_INPUT_REQUIRED", "TASK_STATE_AUTH_REQUIRED"):
            stream = "none"
        return MT.ACK, [Move(Status.ACKED, state, deadline=stream)], state
    if state in FINAL_STATES:
        to = FINAL_STATES[state]
        if to == Status.CANCELED:
            # The state machine cancels what was taken up: a CANCELED that came first
            # (the SDK replays it to a retry of a canceled task) acknowledges it first.
            return MT.TASK_RESPONSE, [Move(Status.ACKED, state, deadline="none"),
                                      Move(Status.CANCELED, state,
                                           "canceled by the responder")], state
        error = "" if to == Status.COMPLETED else f"the responder said {state}"
        return MT.TASK_RESPONSE, [Move(to, state, error)], state
    return MT.EVENT, [], state or "a reply the console cannot read"


def _event(batch: _Batch, frame: ProfileFrame) -> None:
    headers = {"dialect": DIALECT}
    agent = _agent_of(frame.topic, "event")
    # Kept once a distinct frame: the same event published twice on one topic is one row.
    digest = hashlib.sha256(frame.topic.encode() + frame.payload).hexdigest()[:40]
    batch.rows.append(_row(batch, message_id=f"a2a-e{digest}", message_type=MT.EVENT,
                           topic=frame.topic, headers=headers, from_agent=agent))


_last_logged: dict[str, float] = {}


def _log_once_a_minute(what: str, message: str, *args: object) -> None:
    now = time.monotonic()
    if now - _last_logged.get(what, -120.0) >= 60.0:
        _last_logged[what] = now
        log.warning(message, *args)


def profile_traffic_ingest(frames: list[ProfileFrame], *, now: datetime) -> Counter:
    """One transaction for the frames of one bridge batch: their rows stored once each,
    then the changes of the replies this call stored (and of replies stored before their
    request, now that it is), then tasks, numbers and events."""
    batch = _Batch(now=now)
    root = settings.REACH_A2A_ROOT
    limit = settings.REACH_MAX_MESSAGE_BYTES
    for frame in frames:
        if len(frame.payload) > limit:
            batch.counts["rejected:profile_too_large"] += 1
            _log_once_a_minute("too_large", "skipped an A2A-over-MQTT message of %d bytes on "
                               "%s (REACH_MAX_MESSAGE_BYTES=%d)", len(frame.payload),
                               frame.topic[:200], limit)
            continue
        doc = _read(frame.payload)
        if doc is None:
            batch.counts["rejected:profile_not_json"] += 1
            _log_once_a_minute("not_json", "skipped an A2A-over-MQTT message on %s: not a "
                               "JSON object", frame.topic[:200])
            continue
        tree = frame.topic[len(root) + 1:].split("/", 1)[0]
        if tree == "request":
            _request(batch, frame, doc)
        elif tree == "reply":
            _reply(batch, frame, doc)
        elif tree == "event":
            _event(batch, frame)
    if not batch.rows:
        return batch.counts
    ledger = Ledger()
    with transaction.atomic():
        _requests_placed(batch)
        targets = _targets(batch)
        _pooled_replies_check(batch, targets)
        fresh = messages_insert_new(batch.rows, ledger=ledger)
        batch.counts["stored"] += len(fresh)
        inserted = {id(row) for row in fresh}
        changes: list[Change] = []
        pushed: set[str] = set()
        for row_id, (_, _, moves, ours) in batch.replies.items():
            target = targets.get(row_id)
            if target is None:
                continue
            if row_id in inserted:
                changes += _changes(target, moves, now=now, ours=ours)
            # Every item of a stream heard, a repeat too, moves an acknowledged request's
            # deadline on (an identical WORKING is stored once, but it is news).
            if any(m.to == Status.ACKED and m.deadline == "idle" for m in moves):
                pushed.add(target)
        changes += _late_replies(fresh, inserted=inserted, now=now)
        applied = changes_apply(changes, now=now, ledger=ledger)
        batch.counts["stale_answers"] += applied.skipped
        released: list[int] = []
        if applied.freed:
            # Answers to the console's own sends free their agents' slots: work held behind
            # them goes now (messages/backpressure.py), as after a native answer.
            released, undeliverable = held_release(agent_ids=applied.freed, now=now)
            more = changes_apply(undeliverable, now=now, ledger=ledger)
            applied.events += more.events
            if released:
                outbox_wake()
        if pushed:
            until = now + timedelta(milliseconds=settings.REACH_A2A_STREAM_IDLE_MS)
            Message.objects.filter(message_id__in=pushed, status=Status.ACKED,
                                   direction=Direction.OBSERVED,
                                   deadline_at__lt=until).update(deadline_at=until)
        ledger.write()
        events: list[dict] = []
        for row in fresh:
            events += message_events(row, previous="")
        events += applied.events
        events_on_commit(events)
    for row in fresh:
        for rule in row.headers.get("violations", ()):
            batch.counts[f"profile_violations:{rule}"] += 1
            _log_once_a_minute(rule, "A2A-over-MQTT traffic breaks the profile (%s) on %s",
                               rule, row.topic[:200])
    return batch.counts


def _task_suffixed(key: str, task: str) -> str:
    return f"{key}-{hashlib.sha256(task.encode()).hexdigest()[:8]}"


def _requests_placed(batch: _Batch) -> None:
    """Before the insert: each request's attempt number among its task's, and its key when
    its Response Topic and Correlation Data were used before by another task (a key made
    of its task too; flagged when that other request is still open)."""
    requests = [r for r in batch.rows if r.message_type in (MT.TASK_REQUEST, MT.CANCEL)
                and not r.in_reply_to]
    if not requests:
        return
    stored = {m: (t, s) for m, t, s in Message.objects.filter(
        message_id__in=[r.message_id for r in requests]).values_list(
        "message_id", "task_id", "status")}
    for row in requests:
        earlier = stored.get(row.message_id)
        if earlier is not None and earlier[0] != row.task_id:
            if earlier[1] in (Status.OBSERVED, Status.ACKED):
                _violation(row.headers, "correlation_reused")
            row.message_id = _task_suffixed(row.message_id, row.task_id)
    tasks = {r.task_id for r in requests if r.task_id and r.message_type == MT.TASK_REQUEST}
    if not tasks:
        return
    made = dict(Message.objects.filter(
        task_id__in=tasks, message_type=MT.TASK_REQUEST, direction=Direction.OBSERVED)
        .values_list("task_id").annotate(n=Count("id")))
    for row in requests:
        if row.message_type == MT.TASK_REQUEST and row.task_id:
            made[row.task_id] = made.get(row.task_id, 0) + 1
            row.attempt = made[row.task_id]


def _targets(batch: _Batch) -> dict[int, str]:
    """The TASK_REQUEST each reply answers: the row its key names, or the one its task's
    suffix names when the key's row is another task's (Correlation Data used again); in
    this batch or stored before. A reply to anything else (a GetTask, a request never
    heard) moves nothing; a reply heard before its request is stored with the key it
    names, and moves it once the request comes (`_late_replies`)."""
    if not batch.replies:
        return {}
    wanted = set()
    for key, task, _, _ in batch.replies.values():
        wanted.add(key)
        if task:
            wanted.add(_task_suffixed(key, task))
    known = {r.message_id: (r.task_id, r.message_type, r.status) for r in batch.rows
             if r.message_id in wanted}
    known.update({m: (t, k, s) for m, t, k, s in Message.objects.filter(
        message_id__in=wanted - set(known)).values_list("message_id", "task_id",
                                                        "message_type", "status")})
    retried = {key for key, _, _, ours in batch.replies.values()
               if ours and known.get(key, ("", "", ""))[2] == Status.RETRIED}
    now_open = _attempts_under_way(retried)
    out: dict[int, str] = {}
    rows = {id(r): r for r in batch.rows}
    for row_id, (key, task, _, ours) in batch.replies.items():
        target = key
        # The console never uses a Correlation Data twice: a reply on its own topic answers
        # the row its key names, whatever task id the agent gives it.
        if task and not ours and key in known and known[key][0] != task:
            target = _task_suffixed(key, task)
        found = known.get(target, ("", "", ""))
        answers_request = found[1] == MT.TASK_REQUEST
        if ours and target in now_open:
            # An attempt the console gave up waiting for is answered after all (the
            # responder was slow, or took it late): its task's attempt now under way
            # takes the answer, as the profile's requester holds every Correlation Data
            # of its task valid.
            target = now_open[target]
        rows[row_id].in_reply_to = target
        if answers_request:
            out[row_id] = target
    return out


def _attempts_under_way(retried: set[str]) -> dict[str, str]:
    """For each retried attempt of the console's (by message id), the attempt of its chain
    under way now: its retry, that one's retry and so on (`resend_of`), when the last is
    still open."""
    if not retried:
        return {}
    rows = {m: (pk, t) for m, pk, t in Message.objects.filter(message_id__in=retried)
            .values_list("message_id", "pk", "task_id")}
    chain = {parent: (pk, message_id, status) for pk, message_id, status, parent in
             Message.objects.filter(task_id__in={t for _, t in rows.values()},
                                    direction=Direction.SEND, message_type=MT.TASK_REQUEST,
                                    target_node_id=PROFILE_NODE_ID, resend_of__isnull=False)
             .values_list("pk", "message_id", "status", "resend_of")[:1000]}
    out = {}
    for message_id, (pk, _) in rows.items():
        last, hops = None, 0
        while pk in chain and hops < 100:
            pk, next_id, status = chain[pk]
            last, hops = (next_id, status), hops + 1
        if last and last[1] in (Status.SENT, Status.PUBLISHED, Status.ACKED, Status.RETRYING):
            out[message_id] = last[0]
    return out


def _late_replies(fresh: list[ReceivedRow], *, inserted: set[int], now: datetime
                  ) -> list[Change]:
    """The replies stored before the requests this call stored (another bridge, an earlier
    batch: MQTT orders nothing across topics), in the order they were stored."""
    keys = [r.message_id for r in fresh if r.message_type == MT.TASK_REQUEST]
    if not keys:
        return []
    batch_ids = {r.message_id for r in fresh}
    changes: list[Change] = []
    for message_id, key, headers in (Message.objects.filter(in_reply_to__in=keys)
                                     .order_by("created_at", "id")
                                     .values_list("message_id", "in_reply_to", "headers")):
        if message_id in batch_ids:
            continue  # stored now: its changes are made already
        moves = [Move(**m) for m in (headers or {}).get("moves", ())
                 if isinstance(m, dict) and set(m) == {"to", "reason", "error", "deadline"}]
        changes += _changes(key, moves, now=now)
    return changes


def _pooled_replies_check(batch: _Batch, targets: dict[int, str]) -> None:
    """A reply to a pooled request must name its responder (`a2a-responder-agent-id`)."""
    rows = {id(r): r for r in batch.rows}
    unnamed = {i: t for i, t in targets.items() if "responder" not in rows[i].headers}
    if not unnamed:
        return
    pooled = {r.message_id for r in batch.rows if r.headers.get("pool")}
    rest = set(unnamed.values()) - pooled
    if rest:
        pooled |= set(Message.objects.filter(message_id__in=rest, headers__pool__isnull=False)
                      .values_list("message_id", flat=True))
    for row_id, target in unnamed.items():
        if target in pooled:
            _violation(rows[row_id].headers, "pooled_reply_without_responder")
