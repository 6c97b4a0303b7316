"""Canceling a task (PROTOCOL.md, "Tasks, numbers and alarms"): every open transmission of
the console's own task ends CANCELED with the reason and who asked; nothing more is sent
for it; the nodes that may already have it are told with a CANCEL message; a late answer is
recorded on its own row and reopens nothing (CANCELED is in no answer's TRANSITIONS).

Lock order (messages/backpressure.py): the task's advisory lock, its message rows, then the agents'
load rows (changes_apply), then the outbox rows this inserts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.utils import timezone

from directory.routing import namespace_of
from messages.backpressure import held_release, task_locks
from messages.events import events_on_commit, message_events
from messages.ledger import Ledger, task_key
from messages.models import CANCELABLE_STATUSES, Change, Direction, Message, Status, Task
from messages.outbox import outbox_wake
from messages.profile_send import is_profile_row, profile_cancel_row
from messages.protocol import MessageType
from messages.rows import cancel_row
from messages.state import atomic_retrying, changes_apply, messages_insert_new
from messages.taskbook import within_namespaces
from reachconsole.core.audit import audit_record
from reachconsole.core.errors import ConsoleError

MAX_REASON = 500
# Bulk cancel takes at most this many tasks at once, like bulk resend.
BULK_CANCEL_MAX = 500


class CancelRefused(ConsoleError):
    code = "cancel_refused"
    status = 409


@dataclass
class Canceled:
    task_id: str
    rows: list[Message] = field(default_factory=list)  # the transmissions now CANCELED
    was: dict[str, str] = field(default_factory=dict)  # message id → status before
    told: list[str] = field(default_factory=list)  # nodes sent a CANCEL

    def words(self) -> str:
        open_words = ", ".join(f"{message_id} ({status})"
                               for message_id, status in sorted(self.was.items()))
        told = (f"; CANCEL sent to {', '.join(sorted(set(self.told)))}" if self.told
                else "; nothing had reached a node")
        return f"canceled {open_words}{told}"


def _open_rows(task_id: str, member: str | None) -> list[Message]:
    rows = list(Message.objects.select_for_update()
                .filter(task_id=task_id, direction=Direction.SEND,
                        message_type=MessageType.TASK_REQUEST,
                        status__in=sorted(CANCELABLE_STATUSES)).order_by("id"))
    if member is not None:
        rows = [r for r in rows if task_key(r)[2] == member]
    return rows


def _on_the_bus(row: Message, now: datetime) -> bool:
    """Whether the target node may have it: the broker took it, or a bridge claimed it and
    may be publishing it right now (a claim moves publish_at ahead: messages/outbox.py)."""
    if row.status in (Status.PUBLISHED, Status.ACKED) or row.published_at:
        return True
    return row.status == Status.SENT and row.publish_at is not None and row.publish_at > now


def _not_found(task_id: str) -> ConsoleError:
    return ConsoleError(f"no task {task_id[:200]} is recorded", code="task_not_found",
                        status=404)


def _refusal(task_id: str, member: str | None, within: frozenset[str] | None
             ) -> ConsoleError:
    # A caller bound to namespaces learns nothing of other namespaces' tasks: not found.
    tasks = within_namespaces(Task.objects.filter(task_id=task_id), within)
    if member is not None:
        tasks = tasks.filter(member=member)
    found = list(tasks.order_by("direction", "member"))
    if not found:
        return _not_found(task_id)
    ours = [t for t in found if t.direction == Direction.SEND]
    if not ours:
        return CancelRefused(f"task {task_id[:200]} is not the console's: it was "
                             f"{found[0].get_direction_display()}, and the console never acts "
                             "on other nodes' work", code="not_ours")
    states = ", ".join(sorted({t.status for t in ours}))
    return CancelRefused(f"task {task_id[:200]} is already final ({states}): nothing is open "
                         "to cancel", code="task_final")


def task_cancel(*, task_id: str, by: str, reason: str = "", member: str | None = None,
                within: frozenset[str] | None = None, now: datetime | None = None
                ) -> Canceled:
    """Cancel the console's own task `task_id` (one member of a group send with `member`).
    Held, retrying and SENT rows end CANCELED and are never transmitted; PUBLISHED and ACKED
    ones end CANCELED and their node is sent CANCEL. 404 when no such task, 409 when nothing
    of it is open. Audited, done or refused."""
    reason = (reason or "").strip()[:MAX_REASON]
    try:
        done = atomic_retrying(lambda: _cancel(task_id=task_id, by=by, reason=reason,
                                               member=member, within=within,
                                               now=now or timezone.now()))
    except ConsoleError as exc:
        audit_record(actor=by, action="cancel", target=task_id[:200], result="refused",
                     detail=exc.detail)
        raise
    return done


def _cancel(*, task_id: str, by: str, reason: str, member: str | None,
            within: frozenset[str] | None, now: datetime) -> Canceled:
    task_locks([task_id])
    rows = _open_rows(task_id, member)
    if not rows:
        raise _refusal(task_id, member, within)
    if within is not None:
        touched = {namespace_of(a) for r in rows for a in (r.from_agent_id, r.to_agent_id)}
        if not touched & within:  # none of its own: as if it did not exist
            raise _not_found(task_id)
        if not (touched - {None}) <= within:
            raise ConsoleError("this task also touches namespaces this caller is not bound "
                               "to", code="namespace_forbidden", status=403)
    words = f"canceled by {by or 'an operator'}" + (f": {reason}" if reason else "")
    bus = {r.pk for r in rows if _on_the_bus(r, now)}
    was = {r.message_id: r.status for r in rows}
    changes = [Change(pk=r.pk, to=Status.CANCELED, allowed=frozenset({r.status}),
                      actor="operator", by=by, reason=words,
                      fields={"error": words, "finished_at": now, "held": False,
                              "publish_at": None, "ack_deadline_at": None,
                              "next_attempt_at": None})
               for r in rows]
    # Tasks and numbers written once, last: after every message and load row (lock order).
    ledger = Ledger()
    applied = changes_apply(changes, now=now, ledger=ledger)
    if len(applied.messages) != len(rows):  # every row is locked: only a bug gets here
        raise CancelRefused("the task changed while it was being canceled; try again",
                            code="cancel_raced")
    done = Canceled(task_id=task_id, rows=rows, was=was)
    events = list(applied.events)
    # One CANCEL per node: it names the task, not the transmission. An agent of the
    # A2A-over-MQTT profile is told with the profile's CancelTask, one per agent.
    per_node: dict[str, Message] = {}
    for r in rows:
        if r.pk in bus and r.target_node_id:
            if is_profile_row(r):
                told = profile_cancel_row(request=r, now=now)  # a pool's: to its member
                per_node[told.to_agent_id] = told
            else:
                per_node[r.target_node_id] = cancel_row(request=r, now=now)
    sent = messages_insert_new(list(per_node.values()), ledger=ledger)
    for row in sent:
        events += message_events(row, previous="")
        done.told.append(row.to_agent_id if is_profile_row(row) else row.target_node_id)
    publish = [row.pk for row in sent]
    if applied.freed:
        # Slots freed: work held behind the canceled ones may go now.
        released, undeliverable = held_release(agent_ids=applied.freed, now=now)
        publish += released
        events += changes_apply(undeliverable, now=now, ledger=ledger).events
    ledger.write()
    events_on_commit(events)
    if publish:
        outbox_wake()
    audit_record(actor=by, action="cancel", target=task_id[:200], detail=done.words()
                 + (f"; reason: {reason}" if reason else ""))
    return done


def tasks_cancel_bulk(*, task_ids: list[str], by: str, reason: str = "",
                      within: frozenset[str] | None = None) -> tuple[list[Canceled],
                                                                     list[tuple[str, str]]]:
    """Cancel many tasks, each on its own (one that is final meanwhile is reported, not
    fatal). Returns what was canceled and (task id, why not) for the rest. Audited one row a
    task and one for the batch."""
    ids = list(dict.fromkeys(task_ids))[:BULK_CANCEL_MAX]
    done, refused = [], []
    for task_id in ids:
        try:
            done.append(task_cancel(task_id=task_id, by=by, reason=reason, within=within))
        except ConsoleError as exc:
            refused.append((task_id, exc.detail))
    audit_record(actor=by, action="cancel-bulk", target=f"{len(ids)} tasks",
                 detail=f"canceled {len(done)}, {len(refused)} not (already final or gone)"
                 + (f"; reason: {reason}" if reason else ""))
    return done, refused
