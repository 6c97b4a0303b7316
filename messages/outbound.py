"""Sending: every send is a row first, then a resolution; a row to publish is left in the
outbox (messages/outbox.py) for a bridge to claim. PROTOCOL.md "Outbound state machine"."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from django.conf import settings
from django.utils import timezone

from directory.resolver import Resolution, is_local_agent, resolve, resolve_agent_node
from directory.routing import group_members, isolation_refusal, namespace_of, route_capability
from messages import protocol
from messages.backpressure import Capacities, loads_lock, loads_of, task_locks
from messages.delivery import busy_reason, storm_refusal, transmissions_in_window
from messages.events import events_on_commit, message_events
from messages.handlers import console_agent_run
from messages.ledger import Ledger, group_member_key
from messages.models import (
    RESENDABLE_STATUSES,
    Direction,
    Message,
    Status,
    Transition,
)
from messages.outbox import outbox_wake
from messages.profile_send import is_profile_row, pool_resolution, profile_request_shape
from messages.rows import local_response_row, request_row, row_encode, row_log_fields
from messages.state import atomic_retrying
from reachconsole.core.audit import audit_record
from reachconsole.core.errors import ConsoleError
from reachconsole.core.metrics import counters_add
from roster.ids import profile_agent_id, profile_pool_id, stored_agent_id
from roster.models import PROFILE_NODE_ID

log = logging.getLogger(__name__)

_warned: dict[str, float] = {}
WARN_EVERY_S = 60.0


class SendRefused(ConsoleError):
    """The send is not accepted at all: nothing is written."""

    code = "send_refused"
    status = 422


def _warn_once(row: Message, reason: str) -> None:
    last = _warned.get(row.to_agent_id, 0.0)
    if time.monotonic() - last > WARN_EVERY_S:
        _warned[row.to_agent_id] = time.monotonic()
        log.warning("undeliverable to %s: %s", row.to_agent_id, reason,
                    extra=row_log_fields(row))


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
    # The namespaces the caller may reach (a service token bound to namespaces); None: any.
    # Routing never looks outside them, and a resolution that lands outside is refused.
    within: frozenset[str] | None = None


CAPABILITY_PREFIX = "capability:"
RETRY_STORM = "retry_storm"


def _resolve_target(request: SendRequest, now: datetime) -> tuple[str, Resolution]:
    """(the agent id to record, the directory's answer) for one send."""
    to = request.to.strip()
    if to.startswith(CAPABILITY_PREFIX):
        capability = to[len(CAPABILITY_PREFIX):].strip()
        if not capability:
            raise SendRefused("name the capability: `capability:web_search`")
        resolution = route_capability(capability=capability, from_agent_id=request.from_agent_id,
                                      unacked=loads_of, within=request.within, now=now)
        return resolution.agent_id or to, resolution
    if to.startswith("@"):
        resolution = resolve(mention=to, target_node_id=request.target_node_id,
                             namespace=namespace_of(request.from_agent_id),
                             namespaces=request.within, now=now)
        _refuse_outside(request, resolution.agent_id)  # never outside: resolve() keeps in
        return resolution.agent_id or to, resolution
    pool = profile_pool_id(to)
    if pool:
        # An A2A-over-MQTT pool, or the member that answered this task before.
        _refuse_outside(request, pool)
        resolution = pool_resolution(pool_id=pool, task_id=request.task_id)
        return resolution.agent_id or pool, resolution
    agent_id = stored_agent_id(to)  # `fin.tax`, `fin/tax`, or a profile's `org/unit/agent`
    _refuse_outside(request, agent_id)
    return agent_id, resolve_agent_node(to_agent_id=agent_id,
                                        target_node_id=request.target_node_id or None, now=now)


def _refuse_outside(request: SendRequest, agent_id: str | None) -> None:
    """A caller bound to namespaces reaches nothing outside them, however it names the agent
    (the agent is not named back: its existence is another namespace's business)."""
    if request.within is None or agent_id is None:
        return
    if namespace_of(agent_id) not in request.within:
        allowed = ", ".join(sorted(request.within)) or "none"
        raise SendRefused(f"{request.to[:265]} is outside the namespaces this caller may reach "
                          f"({allowed})", code="namespace_forbidden", status=403)


def _visible(resolution: Resolution, within: frozenset[str] | None) -> list[dict]:
    return [c.as_dict() for c in resolution.candidates
            if within is None or namespace_of(c.agent_id) in within]


def message_send(*, request: SendRequest, actor: str = "api", by: str = "",
                 now: datetime | None = None) -> Message:
    """Record a TASK_REQUEST and route it. Returns the row in its resulting status.

    SENT (handed to the bridge after commit, or held behind the agent's maxInflight),
    LOCAL_CONSUMED, BUSY (too many held), or UNDELIVERABLE with the reason and the
    candidates considered. Input the console cannot send at all raises SendRefused and
    writes nothing.
    """
    return messages_send(requests=[request], actor=actor, by=by, now=now).rows[0]


@dataclass
class Sent:
    rows: list[Message]
    refused: list[tuple[SendRequest, SendRefused]]


def messages_send(*, requests: list[SendRequest], actor: str = "api", by: str = "",
                  now: datetime | None = None, skip_refused: bool = False) -> Sent:
    """Send many tasks in one transaction (a bulk resend, a burst). A request the console
    refuses (isolation, retry-storm guard, bad payload) raises, or with `skip_refused` is
    left out and reported."""
    now = now or timezone.now()
    prepared: list[tuple[Message, Resolution]] = []
    refused: list[tuple[SendRequest, SendRefused]] = []
    resolved: dict[tuple, tuple[str, Resolution]] = {}
    for request in requests:
        try:
            key = (request.to, request.target_node_id, request.from_agent_id, request.within,
                   # a pool's follow-ups go to the member that answered that task
                   request.task_id if profile_pool_id(request.to.strip()) else None)
            if key not in resolved:
                resolved[key] = _resolve_target(request, now)
            to_agent_id, resolution = resolved[key]
            prepared.append((_prepared_row(request, to_agent_id, resolution, now), resolution))
        except SendRefused as exc:
            if not skip_refused:
                raise
            refused.append((request, exc))
    storm: list[tuple[Message, SendRefused]] = []
    rows = atomic_retrying(lambda: _send_and_wake(
        prepared, actor=actor, by=by, now=now, refused=storm if skip_refused else None))
    refused += [(SendRequest(to=row.to_agent_id, task_id=row.task_id), exc)
                for row, exc in storm]
    return Sent(rows=rows, refused=refused)


def _send_and_wake(prepared: list[tuple[Message, Resolution]], *, actor: str, by: str,
                      now: datetime, refused: list | None = None) -> list[Message]:
    """Inside a transaction: write and route the rows; events and the bridges' wake-up leave
    after commit."""
    if refused is not None:
        refused.clear()  # a retried transaction judges the storm guard again
    for row, _ in prepared:
        # A retried transaction starts from the prepared row again.
        row.pk, row._state.adding = None, True
        row.status, row.held, row.publish_at = Status.SENT, False, None
        row.error, row.finished_at = "", None
    rows, publish, events = _send_prepared(prepared, actor=actor, by=by, now=now,
                                           refused=refused)
    events_on_commit(events)
    if publish:
        outbox_wake()
    return rows


def _prepared_row(request: SendRequest, to_agent_id: str, resolution: Resolution,
                  now: datetime) -> Message:
    if resolution.ok:
        refusal = isolation_refusal(from_agent_id=request.from_agent_id,
                                    to_agent_id=resolution.agent_id)
        if refusal:
            raise SendRefused(refusal, code="namespace_isolation", status=403)
    row = _request_row(request, to_agent_id=to_agent_id, node_id=resolution.node_id, now=now)
    row.resolution = {
        "target": request.to, "level": resolution.level, "match": resolution.match,
        "reason": resolution.reason, "candidates": _visible(resolution, request.within),
    }
    if request.within is not None:  # retries and resends of this task stay inside them
        row.resolution["within"] = sorted(request.within)
    return row


def _storm_guard(prepared: list[tuple[Message, Resolution]], *, now: datetime):
    """Split off the rows the retry-storm guard refuses (counting this batch too)."""
    routed = [(row, res) for row, res in prepared if res.ok and not res.local]
    counts = transmissions_in_window({(row.task_id, res.agent_id) for row, res in routed},
                                     now=now)
    keep, refused = [], []
    for row, res in prepared:
        if res.ok and not res.local:
            pair = (row.task_id, res.agent_id)
            refusal = storm_refusal(row.task_id, res.agent_id, counts[pair])
            if refusal:
                refused.append((row, SendRefused(refusal, code=RETRY_STORM, status=429)))
                continue
            counts[pair] += 1
        keep.append((row, res))
    return keep, refused


def _send_prepared(prepared: list[tuple[Message, Resolution]], *, actor: str, by: str,
                   now: datetime, refused: list | None = None
                   ) -> tuple[list[Message], list[int], list[dict]]:
    """Write the rows and move each on. Runs in the caller's transaction; returns the rows,
    the primary keys now due in the outbox, and the events. A row the retry-storm guard
    refuses raises SendRefused, or with a `refused` list is left out and added to it."""
    # Counted under a lock per task: concurrent sends of one task queue here, so each sees
    # the others' rows and the guard cannot be raced (messages/backpressure.py: the lock order).
    task_locks(row.task_id for row, res in prepared if res.ok and not res.local)
    prepared, storm = _storm_guard(prepared, now=now)
    for row, exc in storm:
        counters_add({"storm_refused": 1})
        if refused is None:
            raise exc
        refused.append((row, exc))
    rows, publish, events, firsts = [], [], [], []
    for row, _ in prepared:
        row.save(force_insert=True)
        firsts.append(Transition(message=row, from_status="", to_status=row.status,
                                 at=row.created_at, reason=f"to {row.resolution['target']}",
                                 actor=actor, by=by))
        events += message_events(row, previous="")
        rows.append(row)
    # The first step of every trace is written before the steps that follow it.
    Transition.objects.bulk_create(firsts)
    # The agents' load rows last, all at once: held from here to the commit only.
    capacities = loads_lock(res.agent_id for _, res in prepared if res.ok and not res.local)
    ledger = Ledger()
    for row, resolution in prepared:
        events += _dispatch(row, resolution, capacities, actor=actor, now=now, publish=publish,
                            ledger=ledger)
    capacities.write()
    # Counted as they were routed (held, BUSY, UNDELIVERABLE…), after the load rows.
    ledger.inserted(rows)
    ledger.write()
    return rows, publish, events


def _request_row(request: SendRequest, *, to_agent_id: str, now: datetime,
                 node_id: str | None = None) -> Message:
    """The row for one send, refused (nothing written) when it cannot go on the wire: an
    envelope, or, routed to an agent of the A2A-over-MQTT profile (`node_id` its node), a
    JSON-RPC SendMessage on its request topic (messages/profile_send.py)."""
    row = request_row(request=request, to_agent_id=to_agent_id, now=now)
    try:
        if node_id == PROFILE_NODE_ID:
            profile_request_shape(row, timeout_given=bool(request.timeout_ms), now=now)
        else:
            row_encode(row)
    except protocol.PayloadTooLarge as exc:
        raise SendRefused(str(exc), code="payload_too_large", status=413) from None
    except (TypeError, ValueError) as exc:
        raise SendRefused(f"the payload cannot be sent as JSON: {exc}") from None
    return row


def _dispatch(row: Message, resolution: Resolution, capacities: Capacities, *, actor: str,
              now: datetime, publish: list[int], ledger: Ledger) -> list[dict]:
    """Move a fresh SENT row on: consumed here, undeliverable, BUSY, held, or published."""
    # However it was reached (id, capability, mention), a console agent answers in-process.
    if resolution.local or (resolution.ok and is_local_agent(resolution.agent_id)
                            and resolution.node_id == settings.REACH_NODE_ID):
        return _consume_locally(row, now=now, actor=actor, ledger=ledger)
    if not resolution.ok:
        reason = undeliverable_reason(resolution)
        _warn_once(row, resolution.reason)
        extra = {}
        if profile_agent_id(row.to_agent_id) or profile_pool_id(row.to_agent_id):
            # Meant for the A2A-over-MQTT profile: on its node, so the lists' dialect filter
            # finds it among the profile's.
            extra["target_node_id"] = PROFILE_NODE_ID
        return _move(row, Status.UNDELIVERABLE, reason=reason, actor=actor, now=now,
                     error=reason, finished_at=now, **extra)
    row.target_node_id = resolution.node_id
    if not is_profile_row(row):  # a profile row has its agent's request topic already
        row.topic = protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX, resolution.node_id)
    decision = capacities.decide(row.to_agent_id)
    if decision == "busy":
        reason = busy_reason(row.to_agent_id)
        return _move(row, Status.BUSY, reason=reason, actor=actor, now=now, error=reason,
                     finished_at=now, target_node_id=row.target_node_id, topic=row.topic)
    if decision == "hold":
        row.held = True
    else:
        row.publish_at = now
        publish.append(row.pk)
    row.save(update_fields=["target_node_id", "topic", "held", "publish_at"])
    return []


def messages_send_group(*, group: str, request: SendRequest, actor: str = "api", by: str = "",
                        now: datetime | None = None) -> list[Message]:
    """Fan a task out to every routable member of `#group`: one row per member, one task id,
    so each member's delivery is tracked on its own."""
    now = now or timezone.now()
    label = f"#{group.lstrip('#')}"
    members = group_members(group=label, from_agent_id=request.from_agent_id,
                            within=request.within, now=now)
    live = [m for m in members if m.routable]
    task_id = request.task_id or f"task-{uuid.uuid4()}"
    candidates = [m.as_dict() for m in members]
    prepared = []
    if not live:
        reason = (f"group {label} has no member that can take work now" if members
                  else f"group {label} has no members you may reach")
        row = _request_row(replace(request, task_id=task_id), to_agent_id=label, now=now)
        row.resolution = {"target": label, "level": "group", "reason": reason,
                          "candidates": candidates}
        prepared.append((row, Resolution(None, None, "group", reason, members,
                                         outcome="not_found")))
    for member in live:
        # Each member executes its own copy: its own idempotency key within the task.
        member_key = group_member_key(task_id, member.agent_id)
        member_request = replace(request, task_id=task_id, idempotency_key=member_key)
        row = _request_row(member_request, to_agent_id=member.agent_id,
                           node_id=member.node_id, now=now)
        row.resolution = {"target": label, "level": "group", "reason": f"member of {label}",
                          "candidates": candidates}
        prepared.append((row, Resolution(member.agent_id, member.node_id, "group", "member",
                                         [member])))
    return atomic_retrying(lambda: _send_and_wake(prepared, actor=actor, by=by, now=now))


@dataclass
class NextAttempt:
    """What message_next_attempt did: the new row (None: not made, `why` in words and
    `code` for callers to decide on), the pks now due in the outbox, and the events."""

    row: Message | None
    publish: list[int] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    why: str = ""
    code: str = ""


NOT_RESOLVED = "not_resolved"


def message_next_attempt(
    *, previous: Message, now: datetime, actor: str = "sweeper", exclude_agent: bool = False
) -> NextAttempt:
    """A new transmission of `previous`'s task: new message id, same task id and
    idempotency key, attempt + 1, linked to it, resolved afresh by the directory (for a
    capability, without the agents already tried when `exclude_agent`).

    Runs inside the caller's transaction.
    """
    target = _target_of(previous)
    request = _request_again(previous, attempt=previous.attempt + 1,
                             idempotency_key=previous.idempotency_key)
    kept = None if exclude_agent else _draining_keeps(previous, now)
    if kept is not None:
        # The task was accepted for an agent that has started draining since: it finishes
        # there while the lease holds (a drain routes only new work elsewhere).
        to_agent_id, resolution = previous.to_agent_id, kept
    elif target.startswith(CAPABILITY_PREFIX) and exclude_agent:
        tried = set(Message.objects.filter(task_id=previous.task_id, direction=Direction.SEND)
                    .values_list("to_agent_id", flat=True))
        resolution = route_capability(capability=target[len(CAPABILITY_PREFIX):],
                                      from_agent_id=previous.from_agent_id, exclude=tried,
                                      unacked=loads_of, within=request.within, now=now)
        to_agent_id = resolution.agent_id or target
    elif target.startswith("#"):
        # A group member's retry goes to the same member (drained or not: accepted work).
        resolution = resolve_agent_node(to_agent_id=previous.to_agent_id, now=now,
                                        accepted=True)
        to_agent_id = previous.to_agent_id
    else:
        try:
            to_agent_id, resolution = _resolve_target(request, now)
        except ConsoleError as exc:  # refused outright: the attempt ends, with the words
            return NextAttempt(None, why=exc.detail, code=exc.code)
    if not resolution.ok:
        return NextAttempt(None, why=resolution.reason, code=NOT_RESOLVED)
    try:
        row = _prepared_row(request, to_agent_id, resolution, now)
    except SendRefused as exc:
        return NextAttempt(None, why=exc.detail, code=exc.code)
    row.deadline_at = previous.deadline_at  # the task's deadline, not a new one
    row.resolution["target"] = target
    storm: list[tuple[Message, SendRefused]] = []
    rows, publish, events = _send_prepared([(row, resolution)], actor=actor, by="", now=now,
                                           refused=storm)
    if storm:
        return NextAttempt(None, why=storm[0][1].detail, code=storm[0][1].code)
    return NextAttempt(rows[0], publish, events)


def _draining_keeps(previous: Message, now: datetime) -> Resolution | None:
    """The resolution that keeps a retry on `previous`'s agent when that agent is DRAINING
    and can still take work accepted for it (lease, node), else None: the normal resolution
    then decides, as for any retry."""
    if not previous.target_node_id or previous.to_agent_id.startswith(
            ("#", "@", CAPABILITY_PREFIX)):
        return None  # never routed to an agent: nothing was accepted for one
    explicit = (previous.resolution or {}).get("level") == "explicit"
    resolution = resolve_agent_node(
        to_agent_id=previous.to_agent_id,
        target_node_id=previous.target_node_id if explicit else None, now=now, accepted=True)
    if resolution.ok and resolution.candidates and (
            resolution.candidates[0].status == "DRAINING"):
        return resolution
    return None


def message_reroute(*, busy: Message, now: datetime) -> tuple[Message | None, list[int],
                                                             list[dict]]:
    """After a BUSY answer to a capability send: the same task to the next candidate."""
    target = (busy.resolution or {}).get("target", "")
    if not target.startswith(CAPABILITY_PREFIX):
        return None, [], []
    attempt = message_next_attempt(previous=busy, now=now, actor="bridge", exclude_agent=True)
    return attempt.row, attempt.publish, attempt.events


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


def _consume_locally(row: Message, *, now: datetime, actor: str, ledger: Ledger) -> list[dict]:
    """The console's own agents answer in-process: the request is consumed once, here."""
    row.target_node_id = settings.REACH_NODE_ID
    answer = console_agent_run(agent_id=row.to_agent_id, payload=row.payload, request=row)
    events = _move(row, Status.LOCAL_CONSUMED, reason="handled by the console", actor=actor,
                   now=now, finished_at=now, target_node_id=row.target_node_id,
                   error=answer.error)
    response = local_response_row(request=row, payload=answer.payload, now=now)
    response.save(force_insert=True)
    ledger.inserted([response])
    return events + message_events(response, previous="")


def messages_resend(*, message_ids: list[str], by: str, new_idempotency_key: bool = False,
                    within: frozenset[str] | None = None, note: str = "",
                    now: datetime | None = None) -> list[Message]:
    """An operator's new transmission of failed sends' tasks: new message ids, the same task
    ids, the same idempotency keys (receivers de-duplicate them) unless a re-execution is
    asked for, resolved afresh by the directory inside `within`, linked with resend_of,
    under the storm guard.

    All or nothing: when one of them cannot be resent, none is, and the refusal says which
    and why. A group send that reached no member goes to every member the group has now.
    Audited, one row a message (and one for the batch), whether done or refused."""
    ids = list(dict.fromkeys(message_ids))
    if not ids:
        raise SendRefused("name at least one message to resend", code="nothing_to_resend")
    batch = f"{len(ids)} messages" if len(ids) > 1 else ids[0]

    def resend() -> list[Message]:
        requests = _resend_requests(message_ids=ids, new_idempotency_key=new_idempotency_key,
                                    within=within, now=now or timezone.now())
        rows = messages_send(requests=requests, actor="operator", by=by, now=now).rows
        # In the resend's own transaction: no resend without its audit rows.
        made: dict[str, list[str]] = {}
        for row in rows:
            made.setdefault(row.resend_of.message_id, []).append(f"{row.message_id} "
                                                                   f"({row.status})")
        rekeyed = ("; new idempotency key: the work may run again"
                   if new_idempotency_key else "")
        for message_id in ids:
            audit_record(actor=by, action="resend", target=message_id,
                         detail=f"as {', '.join(made.get(message_id, []))}{rekeyed}")
        if len(ids) > 1:
            audit_record(actor=by, action="resend-bulk", target=batch,
                         detail=f"resent {len(ids)} as {len(rows)} new transmissions{rekeyed}"
                         + (f"; {note}" if note else ""))
        return rows

    try:
        return atomic_retrying(resend)
    except ConsoleError as exc:
        # Nothing was written: the refusal is recorded on its own.
        audit_record(actor=by, action="resend-bulk" if len(ids) > 1 else "resend",
                     target=batch, result="refused",
                     detail=exc.detail + (f"; {note}" if note else ""))
        if len(ids) > 1:
            exc.detail = f"nothing was resent: {exc.detail}"
        raise


def _resend_requests(*, message_ids: list[str], new_idempotency_key: bool,
                     within: frozenset[str] | None, now: datetime) -> list[SendRequest]:
    found = {m.message_id: m for m in Message.objects.filter(
        message_id__in=message_ids, direction=Direction.SEND,
        message_type=protocol.MessageType.TASK_REQUEST)}
    requests: list[SendRequest] = []
    for message_id in message_ids:
        previous = found.get(message_id)
        if previous is None:
            raise SendRefused(f"no sent task request {message_id[:200]} is recorded",
                              code="message_not_found", status=404)
        _refuse_foreign(previous, within)
        if previous.status not in RESENDABLE_STATUSES:
            allowed = ", ".join(sorted(RESENDABLE_STATUSES))
            raise SendRefused(f"{message_id} is {previous.status}; only {allowed} messages are "
                              "resent (the others are still under way or done)",
                              code="not_resendable", status=409)
        if previous.payload_dropped_at is not None:
            when = previous.payload_dropped_at.strftime("%Y-%m-%d %H:%M:%S")
            raise SendRefused(
                f"{message_id}'s payload was dropped at {when} UTC, "
                f"{settings.REACH_PAYLOAD_KEEP_HOURS:g} h after its last change "
                "(REACH_PAYLOAD_KEEP_HOURS), so there is nothing to send again: send the task "
                "anew with its payload", code="payload_dropped", status=409)
        requests += _requests_again(previous, new_idempotency_key=new_idempotency_key,
                                    within=within, now=now)
    return requests


def _refuse_foreign(previous: Message, within: frozenset[str] | None) -> None:
    """A caller bound to namespaces resends only what its namespaces sent or were sent: the
    resend speaks as the original sender."""
    if within is None:
        return
    agents = [previous.from_agent_id]
    if not previous.to_agent_id.startswith(("#", "@", CAPABILITY_PREFIX)):
        agents.append(previous.to_agent_id)
    touched = {namespace_of(a) for a in agents} - {None}
    if not touched or not touched <= within:
        raise SendRefused(f"{previous.message_id} belongs to namespaces this caller is not bound "
                          f"to (it may reach {', '.join(sorted(within)) or 'none'})",
                          code="namespace_forbidden", status=403)


def _requests_again(previous: Message, *, new_idempotency_key: bool,
                    within: frozenset[str] | None, now: datetime) -> list[SendRequest]:
    key = (f"{previous.task_id[:180]}:re-{uuid.uuid4().hex[:8]}" if new_idempotency_key
           else previous.idempotency_key)
    request = _request_again(previous, attempt=1, idempotency_key=key, within=within)
    if not request.to.startswith("#"):
        return [request]
    if not previous.to_agent_id.startswith("#"):  # one member of a group: that member again
        return [replace(request, to=previous.to_agent_id)]
    # The group had no member that could take work then: each member it has now.
    members = [m for m in group_members(group=request.to, from_agent_id=previous.from_agent_id,
                                        within=request.within, now=now) if m.routable]
    if not members:
        raise SendRefused(f"{previous.message_id} went to group {request.to}, which still has "
                          "no member that can take work: register or wake a member first",
                          code="no_member", status=409)
    base = key if new_idempotency_key else previous.task_id
    return [replace(request, to=m.agent_id, idempotency_key=group_member_key(base, m.agent_id))
            for m in members]


def _target_of(message: Message) -> str:
    return (message.resolution or {}).get("target") or message.to_agent_id


def _request_again(previous: Message, *, attempt: int, idempotency_key: str,
                   within: frozenset[str] | None = None) -> SendRequest:
    """The same task as `previous`, to the same target (an explicit node stays explicit;
    anything else is resolved afresh), linked to it, inside the namespaces the task was
    bound to and `within`."""
    explicit = (previous.resolution or {}).get("level") == "explicit"
    bound = (previous.resolution or {}).get("within")
    if bound is not None:
        within = frozenset(bound) if within is None else within & frozenset(bound)
    return SendRequest(
        to=_target_of(previous), payload=previous.payload, task_id=previous.task_id,
        target_node_id=previous.target_node_id if explicit else None,
        from_agent_id=previous.from_agent_id, timeout_ms=previous.headers.get("timeoutMs"),
        conversation_id=previous.conversation_id, scene_group_id=previous.scene_group_id,
        session_id=previous.session_id, idempotency_key=idempotency_key, attempt=attempt,
        resend_of=previous, within=within,
    )
