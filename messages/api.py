"""`/api/a2a/…`: send a task, read a message's whole story."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from ninja import Field, Query, Router, Schema, Status
from pydantic import AfterValidator, BeforeValidator, ConfigDict

from directory.routing import namespace_of
from messages.cancel import task_cancel
from messages.ledger import AGENT, NODE
from messages.models import DONE_STATUSES, FINAL_STATUSES, Direction, Message
from messages.models import Status as TaskState
from messages.outbound import (
    CAPABILITY_PREFIX,
    SendRefused,
    SendRequest,
    message_send,
    messages_resend,
    messages_send_group,
)
from messages.profile_send import is_profile_row, profile_response
from messages.redact import redacted
from messages.rollups import DEFAULT_WINDOW, WINDOWS, subject_stats, window_read
from messages.rows import message_fields
from messages.selectors import (
    FilterError,
    MessageFilter,
    message_replies,
    send_chain,
    task_attempts,
    task_response,
)
from messages.taskbook import MAX_PAGE, task_entries, task_out, task_story, tasks_page
from messages.waits import answer_waits
from reachconsole.core.apidoc import BodyIn, JsonValue, json_int, refusals
from reachconsole.core.errors import ApiError
from reachconsole.core.idle import db_then_idle
from reachconsole.core.moments import utc_moment
from roster.fields import AGENT_ID_INPUT_PATTERN, NAME, AgentIdInput, NodeId
from roster.ids import (
    PROFILE_AGENT_PATTERN,
    PROFILE_POOL_PATTERN,
    agent_id_parse,
    agent_namespace,
    profile_pool_id,
    stored_agent_id,
)
from roster.models import NAME_RE

router = Router(tags=["a2a"])
ops_router = Router(tags=["ops"])


# What `to` may be: an agent id, `@mention`, `capability:name` or `#group`.
# ... or an A2A-over-MQTT profile agent's `org/unit/agent` (roster/ids.py PROFILE_ID_RE).
TO_PATTERN = (rf"^(?:{CAPABILITY_PREFIX}{NAME}|#{NAME}|@.+|{PROFILE_AGENT_PATTERN}|"
              rf"{PROFILE_POOL_PATTERN}|"
              rf"{AGENT_ID_INPUT_PATTERN.removeprefix('^').removesuffix('$')})$")


def _to_check(value: Any) -> Any:
    """The words for a `to` that names nothing the console can send to (the schema's pattern
    holds it to the same forms)."""
    if not isinstance(value, str):
        return value
    if value.startswith(CAPABILITY_PREFIX):
        if not NAME_RE.fullmatch(value.removeprefix(CAPABILITY_PREFIX)):
            raise SendRefused("name the capability: `capability:web_search` (letters, digits, "
                              "'-', '_', '.')")
    elif value.startswith("#"):
        if not NAME_RE.fullmatch(value.removeprefix("#")):
            raise SendRefused(f"`{value[:60]}` is not a group: `#data-processing` (letters, "
                              "digits, '-', '_', '.')")
    elif not value.startswith("@") and not profile_pool_id(value):
        stored_agent_id(value)
    return value


class SendIn(BodyIn):
    # `wait` takes one response, which a group send does not have (422).
    model_config = ConfigDict(json_schema_extra={"not": {
        "required": ["to", "wait"],
        "properties": {"to": {"pattern": "^#"}, "wait": {"const": True}},
    }})

    to: Annotated[str, BeforeValidator(_to_check)] = Field(
        ..., max_length=265, pattern=TO_PATTERN,
        description='"ns.agent", "org/unit/agent" or "org/unit/pool/name" (an A2A-over-MQTT '
        'agent or pool), "@mention", "capability:x" or "#group"')
    payload: JsonValue = None
    task_id: str | None = Field(None, alias="taskId", max_length=120)
    target_node_id: NodeId | None = Field(None, alias="targetNodeId")
    timeout_ms: json_int(ge=100, le=86_400_000) | None = Field(None, alias="timeoutMs")
    wait: bool = False
    from_agent_id: AgentIdInput | None = Field(None, alias="from")
    conversation_id: str = Field("", alias="conversationId", max_length=200)
    scene_group_id: str = Field("", alias="sceneGroupId", max_length=200)
    session_id: str = Field("", alias="sessionId", max_length=200)
    idempotency_key: str | None = Field(None, alias="idempotencyKey", max_length=200)




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
        "payloadDroppedAt": _iso(row.payload_dropped_at),
    }


WAIT_MARGIN_MS = 500
TIMEOUT_WORDS = ("the response did not arrive in time; the task may have been accepted — "
                 "query GET /api/a2a/messages/{id} later")


# A sent message is what the operations on one message take (OpenAPI links).
_MESSAGE_LINKS = {
    "links": {
        name: {"operationId": f"messages_api_{name}",
               "parameters": {"message_id": "$response.body#/messageId"}}
        for name in ("message_detail", "resend")
    },
}


@router.post("/send", response={200: dict, 202: dict, **refusals(429, body=True)},
             openapi_extra={"responses": {200: _MESSAGE_LINKS, 202: _MESSAGE_LINKS}})
async def send(request: HttpRequest, body: SendIn):
    """`to`: an agent id, `@mention`, `capability:name` or `#group` (one row per member).
    With `wait`, answers with the TASK_RESPONSE, or 202 when it does not come in time."""
    if not body.wait:
        status, out = await sync_to_async(_send)(request.auth, body)
        return Status(status, out)
    # Waiting holds no connection and no thread (messages/waits.py): each read gives both
    # back before the wait goes on.
    status, out = await db_then_idle(_send, request.auth, body)
    if out.get("status") == TaskState.LOCAL_CONSUMED:
        # A console agent answered in-process: its response is stored already.
        outcome = await db_then_idle(_task_outcome, out["messageId"])
        return Status(*outcome) if outcome else Status(200, out)
    if out.get("status") != TaskState.SENT:
        return Status(status, out)
    timeout_ms = body.timeout_ms or 30000
    if body.timeout_ms is None and out.get("deadlineAt"):
        # The task's own deadline: an A2A-over-MQTT send's default is the profile's whole
        # requester budget (REACH_A2A_TIMEOUT_MS), not the native 30 s.
        left = datetime.fromisoformat(out["deadlineAt"]) - timezone.now()
        timeout_ms = max(0.0, left.total_seconds() * 1000)
    timeout_s = (timeout_ms + WAIT_MARGIN_MS) / 1000
    outcome = await answer_waits.wait(
        out["taskId"] or out["messageId"], timeout_s=timeout_s,
        check=lambda: db_then_idle(_task_outcome, out["messageId"]))
    if outcome is not None:
        return Status(*outcome)
    # Not SENT any more, most likely: say where the task stands now (e.g. ACKED).
    out = await db_then_idle(_task_state, out["messageId"]) or out
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
        caller.require_namespace(agent_namespace(to))
    if body.wait and to.startswith("#"):
        raise ApiError(422, "invalid_request", "`wait` takes one response: send to an agent, "
                       "a mention or a capability, not a group")
    send_request = SendRequest(
        to=to, payload=body.payload, task_id=body.task_id, target_node_id=body.target_node_id,
        from_agent_id=body.from_agent_id, timeout_ms=body.timeout_ms,
        conversation_id=body.conversation_id, scene_group_id=body.scene_group_id,
        session_id=body.session_id, idempotency_key=body.idempotency_key,
        within=caller.token.namespaces,
    )
    # A SendRefused is a ConsoleError: the API root answers it with its status and words.
    if to.startswith("#"):
        rows = messages_send_group(group=to, request=send_request, by=caller.label)
        fanned_out = rows[0].status != TaskState.UNDELIVERABLE
        out = {"taskId": rows[0].task_id,
               "status": "FANNED_OUT" if fanned_out else TaskState.UNDELIVERABLE.value,
               "messages": [message_out(r) for r in rows],
               "candidates": (rows[0].resolution or {}).get("candidates", [])}
        return (202 if fanned_out else 200), out
    row = message_send(request=send_request, actor="api", by=caller.label)
    out = message_out(row)
    out["candidates"] = (row.resolution or {}).get("candidates", [])
    return (202 if row.status == TaskState.SENT else 200), out




def _task_outcome(message_id: str) -> tuple[int, dict] | None:
    """The task's end once it has one: 200 with its response, or with how its last attempt
    ended; 202 when its own deadline ended it (EXPIRED), which is running out of time: the
    executor may have taken it and be working on it still."""
    attempts = send_chain(message_id=message_id)
    answered = [m for m in attempts if m.status in DONE_STATUSES]
    if answered:
        row = answered[-1]
        out = message_out(row)
        # Not masked (messages/redact.py): this is the result the caller asked for, not a
        # record shown to someone else.
        if is_profile_row(row):
            # The task as the A2A-over-MQTT profile delivered it (messages/profile_send.py).
            out["response"] = profile_response(row)
        else:
            response = task_response(row)
            out["response"] = response.payload if response else None
        return 200, out
    last = attempts[-1] if attempts else None
    if last is None or last.status not in FINAL_STATUSES:
        return None
    out = message_out(last)
    if last.status == TaskState.EXPIRED:
        out["detail"] = TIMEOUT_WORDS.replace("{id}", out["messageId"])
        return 202, out
    return 200, out


def _task_state(message_id: str) -> dict | None:
    """Where the task's latest transmission stands now, answered or not."""
    attempts = send_chain(message_id=message_id)
    return message_out(attempts[-1]) if attempts else None


def _hider(row: Message, namespaces: frozenset[str]):
    """For a namespace-bound caller reading a row another caller may have routed: the
    candidates of its namespaces only, and words that name no other namespace's agent."""
    resolution = dict(row.resolution or {})
    candidates = resolution.get("candidates") or []
    resolution["candidates"] = [c for c in candidates
                                if namespace_of(c.get("agentId")) in namespaces]
    hidden = [c for c in candidates if namespace_of(c.get("agentId")) not in namespaces]

    def hide(text: str) -> str:
        for c in hidden:
            for named in (f"{c.get('agentId')} on {c.get('nodeId')}", c.get("agentId")):
                if named:
                    text = text.replace(named, "(an agent of another namespace)")
        return text

    return resolution, hide


@router.get("/messages/{message_id}", response={200: dict, **refusals(404)})
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
    hide = str
    if namespaces is not None:
        out["resolution"], hide = _hider(row, namespaces)
        out["error"] = hide(row.error) or None
    out["payload"] = redacted(row.payload)
    out["headers"] = redacted(row.headers)
    out["transitions"] = [
        {"from": t.from_status or None, "to": t.to_status, "at": t.at.isoformat(),
         "reason": hide(t.reason) or None, "actor": t.actor, "by": t.by or None}
        for t in row.transitions.all()
    ]
    out["attempts"] = [
        {"messageId": m.message_id, "attempt": m.attempt, "status": m.status}
        for m in task_attempts(row)
        # Another caller's work may carry the same task id: a bound caller sees its own.
        if namespaces is None or {namespace_of(m.from_agent_id),
                                  namespace_of(m.to_agent_id)} & namespaces
    ]
    out["replies"] = [
        {"messageId": m.message_id, "messageType": m.message_type, "status": m.status,
         "payload": redacted(m.payload), "payloadDroppedAt": _iso(m.payload_dropped_at),
         "createdAt": m.created_at.isoformat()}
        for m in message_replies(row)
    ]
    return Status(200, out)


class ResendIn(BodyIn):
    new_idempotency_key: bool = Field(False, alias="newIdempotencyKey")


@router.post("/messages/{message_id}/resend",
             response={202: dict, 200: dict, **refusals(404, 409, 429, body=True)})
def resend(request: HttpRequest, message_id: str, body: ResendIn | None = None):
    """A new transmission of the same task (same task id; the same idempotency key unless
    `newIdempotencyKey`, which asks the receiver to run the work again)."""
    body = body or ResendIn()
    rows = messages_resend(message_ids=[message_id], by=request.auth.label,
                           new_idempotency_key=body.new_idempotency_key,
                           within=request.auth.token.namespaces)
    if len(rows) == 1:
        out = message_out(rows[0])
    else:  # a group send that reached no member, now sent to each member the group has
        out = {"taskId": rows[0].task_id, "status": "FANNED_OUT",
               "messages": [message_out(r) for r in rows]}
    if body.new_idempotency_key:
        out["warning"] = ("sent with a new idempotency key: the receiver will run the work "
                          "again even if it already ran it")
    return Status(202 if any(r.status == TaskState.SENT for r in rows) else 200, out)


# --- tasks: the unit an operator acts on (PROTOCOL.md, "Tasks, numbers and alarms") -------
# A moment as the filters take it: minutes, hours or days back, or a UTC date-time. The
# pattern keeps both within the calendar, so what it calls valid the filter reads.
MOMENT_PATTERN = (r"^(\d{1,7}m?|\d{1,6}h|\d{1,5}d|(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|1\d|2[0-8])"
                  r"(T([01]\d|2[0-3]):[0-5]\d(:[0-5]\d)?(Z|[+-](0\d|1[0-2]):[0-5]\d)?)?)?$")
_MOMENT = re.compile(MOMENT_PATTERN)


def _moment_check(value: str) -> str:
    """The document's pattern is what is always within the calendar; any other date-time
    the filters can read (the 29th to the 31st, a timezone offset) is taken too."""
    if value and not _MOMENT.match(value):
        try:
            utc_moment(value)
        except (ValueError, OverflowError):
            raise ValueError(f"{value[:40]!r} is neither minutes back (60), hours or days "
                             "back (6h, 7d) nor a UTC date-time such as 2026-11-30T14:00"
                             ) from None
    return value


# The pattern is in the document; the words are what a caller reads when it does not match.
Moment = Annotated[str, AfterValidator(_moment_check),
                   Field(max_length=40, json_schema_extra={"pattern": MOMENT_PATTERN})]
TaskStatus = Literal[tuple(s for s in TaskState.values)]
TaskDirection = Literal[tuple(Direction.values)]


class TaskQuery(Schema):
    status: list[TaskStatus] = Field(default_factory=list, description="repeatable")
    agent: str = Field("", max_length=265, description="to or from")
    node: str = Field("", max_length=128)
    dialect: Literal["native", "a2a-mqtt"] | None = Field(
        None, description="native, or a2a-mqtt (the A2A-over-MQTT profile's traffic)")
    namespace: str = Field("", max_length=100)
    since: Moment = Field("", description="minutes back (60), hours or days back (6h, 7d), "
                          "or a UTC date-time (2026-11-30T14:00)")
    until: Moment = ""
    direction: TaskDirection | None = Field(None, description="SEND (the console's own), "
                                            "RECV or OBSERVED (between other nodes)")
    q: str = Field("", max_length=200, description="a task, conversation or message id")
    before: int | None = Field(None, ge=1, le=2**62, description="the `cursor` of the last "
                               "task of the previous page")
    limit: int = Field(100, ge=1, le=MAX_PAGE)


def _task_filter(query: TaskQuery) -> MessageFilter:
    from django.http import QueryDict

    get = QueryDict(mutable=True)
    for status in query.status:
        get.appendlist("status", status)
    for name in ("agent", "node", "dialect", "namespace", "since", "until", "direction", "q"):
        # Every value reached here through the schema; the filter reads it as the page does.
        value = getattr(query, name)
        if value:
            get[name] = value
    return MessageFilter.from_query(get)


@router.get("/tasks", response={200: list[dict], **refusals()})
def tasks_list(request: HttpRequest, response: HttpResponse, query: Query[TaskQuery]):
    """Tasks newest first (by first transmission), keyset paged: pass the last entry's
    `cursor` as `before` for the next page (also in the `Link` header, rel="next"). A
    window whose `since` is later than its `until` holds nothing: an empty list."""
    try:
        flt = _task_filter(query)
    except FilterError as exc:
        if exc.code == "empty_window":
            return Status(200, [])
        raise ApiError(422, "bad_filter", exc.detail) from None
    page = tasks_page(flt, before=query.before, limit=query.limit,
                      namespaces=request.auth.token.namespaces)
    if page.older is not None:
        params = request.GET.copy()
        params["before"] = str(page.older)
        response["Link"] = f'<{request.path}?{params.urlencode()}>; rel="next"'
    return Status(200, [task_out(t) for t in page.rows])


def _one_task(request: HttpRequest, task_id: str):
    entries = task_entries(task_id, namespaces=request.auth.token.namespaces)
    if not entries:
        raise ApiError(404, "task_not_found", f"no task {task_id[:200]} is recorded"
                       + ("" if request.auth.token.namespaces is None
                          else " in the namespaces this token is bound to"))
    return entries


@router.get("/tasks/{task_id}", response={200: dict, **refusals(404, 422)})
def task_detail(request: HttpRequest, task_id: str):
    """The task's entry and `messages`: every row of the task, oldest first. A task id with
    several entries (a group send's members, or the same id seen in two directions) answers
    the console's own first and lists the others in `others`."""
    entries = _one_task(request, task_id)
    story = task_story(entries[0])
    out = task_out(entries[0])
    out["messages"] = [message_out(m) for m in story.messages]
    out["messagesTruncated"] = story.more
    out["others"] = [task_out(t) for t in entries[1:]]
    return Status(200, out)


class CancelIn(BodyIn):
    reason: str = Field("", max_length=500)
    member: str | None = Field(None, max_length=265,
                               description="one member of a group send (default: all)")


@router.post("/tasks/{task_id}/cancel",
             response={200: dict, **refusals(403, 404, 409, 422, body=True)})
def task_cancel_api(request: HttpRequest, task_id: str, body: CancelIn | None = None):
    """Every open transmission of the task ends CANCELED; nodes that may have it are sent
    CANCEL. 409 when the task is already final."""
    body = body or CancelIn()
    done = task_cancel(task_id=task_id, by=request.auth.label, reason=body.reason,
                       member=body.member, within=request.auth.token.namespaces)
    entries = task_entries(task_id)
    out = task_out(entries[0]) if entries else {"taskId": task_id}
    out["canceled"] = [{"messageId": m, "was": was} for m, was in sorted(done.was.items())]
    out["cancelSentTo"] = sorted(set(done.told))
    return Status(200, out)


# --- numbers per agent and node (kept at write time: messages/ledger.py) ------------------
class StatsQuery(Schema):
    window: Literal[tuple(WINDOWS)] = Field(DEFAULT_WINDOW, description="the last 5 minutes to "
                                            "24 hours")


@ops_router.get("/agents/{agent_id}/stats", response={200: dict, **refusals(400, 403, 422)})
def agent_stats(request: HttpRequest, agent_id: str, query: Query[StatsQuery]):
    """Tasks sent to the agent in the window and what became of them, with publish → ACK
    and sent → answered percentiles (from histograms: see the bounds)."""
    window = window_read(query.window)
    namespace = namespace_of(agent_id)
    if namespace is not None:
        request.auth.require_namespace(namespace)
    out = subject_stats(scope=AGENT, subject=agent_id, window=window).as_json()
    out["agentId"] = agent_id
    return Status(200, out)


@ops_router.get("/nodes/{node_id}/stats", response={200: dict, **refusals(400, 403, 422)})
def node_stats(request: HttpRequest, node_id: str, query: Query[StatsQuery]):
    """The same numbers for every task sent to agents on the node."""
    window = window_read(query.window)
    if request.auth.token.namespaces is not None:
        raise ApiError(403, "namespace_forbidden", "a node's numbers span namespaces: a token "
                       "bound to namespaces reads its agents' numbers instead")
    out = subject_stats(scope=NODE, subject=node_id, window=window).as_json()
    out["nodeId"] = node_id
    return Status(200, out)
