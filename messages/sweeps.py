"""The delivery sweep (Celery beat, every REACH_RETRY_SWEEP_S): unanswered transmissions
become retries or end, due retries go out as new attempts, held messages get freed slots,
and no open row outlives its task's deadline.

Every claim is `select_for_update(skip_locked=True)` plus a status-guarded change, so two
sweepers running at once never send the same attempt; a sweeper killed mid-claim rolls back
and the rows wait for the next sweep. Lock order: messages/backpressure.py has it.

The console does not blame an agent for its own deafness: while no bridge hears the bus, and
for one ack timeout after one hears again (the broker is still delivering what queued up),
silence from a receiver is not judged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from messages.backpressure import held_release, loads_to_release, task_locks
from messages.delivery import retry_or_give_up, silence_words
from messages.events import events_on_commit
from messages.models import OPEN_STATUSES, Change, Direction, Message, Status, Task, Transition
from messages.outbound import RETRY_STORM, message_next_attempt
from messages.outbox import outbox_wake
from messages.partitions import history_partitioned, legacy_end
from messages.protocol import MessageType
from messages.selectors import retention_behind_s
from messages.state import atomic_retrying, changes_apply
from roster.hearing import bus_hearing

log = logging.getLogger(__name__)

SWEEP_BATCH = 500


@dataclass
class SweepResult:
    retrying: int = 0
    given_up: int = 0
    attempts: int = 0
    released: int = 0
    ended: int = 0
    publish: list[int] = field(default_factory=list)


def _heard_through(now: datetime) -> datetime | None:
    """Up to when a receiver's silence may be judged (roster/hearing.py, the one rule): the
    moment up to which the console has proof it heard the bus, once it has heard for one
    ACK timeout; None while it has not."""
    hearing = bus_hearing(now=now)
    if hearing is None:
        return None
    return hearing.through_once_heard_for(timedelta(milliseconds=settings.REACH_ACK_TIMEOUT_MS))


def _overdue(now: datetime, result: SweepResult) -> list[dict]:
    """Published task requests with no ACK by their ack deadline: another attempt, or the
    end when attempts or the task's time ran out."""
    through = _heard_through(now)
    if through is None:
        return []
    rows = list(
        Message.objects.select_for_update(skip_locked=True)
        .filter(status=Status.PUBLISHED, ack_deadline_at__lt=min(now, through),
                direction=Direction.SEND, message_type=MessageType.TASK_REQUEST)
        .order_by("ack_deadline_at")[:SWEEP_BATCH]
    )
    changes = []
    published = frozenset({Status.PUBLISHED})
    for row in rows:
        silence = silence_words(row)
        status, fields, why = retry_or_give_up(row, now=now)
        if status:
            changes.append(Change(pk=row.pk, to=status, allowed=published, actor="sweeper",
                                  reason=f"{silence}; {why}",
                                  fields={"ack_deadline_at": None, **fields}))
            result.retrying += 1
            continue
        words = f"{silence} on attempt {row.attempt}, and no retry: {why}"
        changes.append(Change(pk=row.pk, to=Status.EXPIRED, allowed=published,
                              actor="sweeper", reason=words,
                              fields={"error": words, "finished_at": now,
                                      "ack_deadline_at": None}))
        result.given_up += 1
    return changes_apply(changes, now=now).events


def _due_attempts(now: datetime) -> SweepResult:
    """Due retries, each in a transaction of its own: an attempt locks its row, then its
    agent's load row (the lock order); several attempts in one transaction would take load
    rows in no order."""
    result = SweepResult()
    due = list(Message.objects.filter(status=Status.RETRYING, next_attempt_at__lte=now)
               .order_by("next_attempt_at").values_list("pk", flat=True)[:SWEEP_BATCH])
    for pk in due:
        part = atomic_retrying(lambda pk=pk: _run_step(
            lambda now, tally, pk=pk: _due(now, tally, pk=pk), now))
        result.given_up += part.given_up
        result.attempts += part.attempts
        result.publish += part.publish
    return result


def _due(now: datetime, result: SweepResult, *, pk: int) -> list[dict]:
    # The task's lock before its row: the order sends take (messages/backpressure.py).
    task_locks(Message.objects.filter(pk=pk).values_list("task_id", flat=True))
    rows = list(Message.objects.select_for_update(skip_locked=True)
                .filter(pk=pk, status=Status.RETRYING, next_attempt_at__lte=now))
    events: list[dict] = []
    changes = []
    retrying = frozenset({Status.RETRYING})
    for row in rows:
        if row.deadline_at and row.deadline_at <= now:
            continue  # _past_deadline ends it
        attempt = message_next_attempt(previous=row, now=now)
        new = attempt.row
        if new is None:
            # The storm guard refusing it is the retries running out, not a lost address.
            terminal = Status.EXPIRED if attempt.code == RETRY_STORM else Status.UNDELIVERABLE
            words = f"attempt {row.attempt + 1} not made: {attempt.why}"
            changes.append(Change(pk=row.pk, to=terminal, allowed=retrying, actor="sweeper",
                                  reason=words, fields={"error": words, "finished_at": now}))
            result.given_up += 1
            continue
        events += attempt.events
        result.publish += attempt.publish
        result.attempts += 1
        changes.append(Change(pk=row.pk, to=Status.RETRIED, allowed=retrying, actor="sweeper",
                              reason=f"attempt {new.attempt} is {new.message_id}",
                              fields={"finished_at": now}))
    return events + changes_apply(changes, now=now).events


def _deadline_words(row: Message) -> tuple[str, str]:
    """(terminal status, reason) for an open row whose deadline passed, by what it waited
    for: the console's own work says so, a receiver's silence says what was missing."""
    timeout = (row.headers or {}).get("timeoutMs")
    within = f"within {timeout} ms" if timeout else "before its deadline"
    if row.direction == Direction.OBSERVED:
        idle = (row.headers or {}).get("idleMs")
        if row.status == Status.ACKED and idle:
            # The A2A-over-MQTT profile's stream (messages/profile_traffic.py): each item
            # moved the deadline on by its idle timeout.
            return Status.EXPIRED, (f"acknowledged on the bus, then nothing for {idle} ms "
                                    "(the profile's stream idle timeout)")
        if row.status == Status.ACKED:
            return Status.EXPIRED, f"acknowledged on the bus, no response seen {within}"
        return Status.EXPIRED, f"no answer seen on the bus {within}"
    if row.message_type != MessageType.TASK_REQUEST:
        return Status.FAILED, (f"the MQTT broker did not take this {row.message_type} {within}"
                               ": the console could not publish it (broker unreachable?)")
    if row.status == Status.SENT and row.held:
        return Status.EXPIRED, (f"held behind {row.to_agent_id}'s maxInflight and not sent "
                                f"{within} (the task's timeoutMs)")
    if row.status == Status.SENT:
        return Status.FAILED, (f"not published {within} (the task's timeoutMs): the console "
                               "could not hand it to the MQTT broker (no bridge running, or "
                               "the broker unreachable)")
    if row.status == Status.PUBLISHED:
        return Status.EXPIRED, f"published, no ACK {within} (the task's timeoutMs)"
    if row.status == Status.ACKED:
        return Status.EXPIRED, f"acknowledged, no response {within}"
    return Status.EXPIRED, "the task's deadline (timeoutMs) passed before the next attempt"


def _past_deadline(now: datetime, result: SweepResult) -> list[dict]:
    """No open row outlives its deadline: each open status of a task request ends here at
    the latest, and an answer of ours that the broker never took. When the console could
    not hear the bus, the words say so: the silence may be its own, and a late response
    still completes the row."""
    # An answer of ours is done once it left SENT (the receiver may ACK it before our
    # PUBACK is recorded): it only leaves the deadline index.
    Message.objects.filter(deadline_at__lt=now, status__in=list(OPEN_STATUSES - {Status.SENT})
                           ).exclude(message_type=MessageType.TASK_REQUEST).update(deadline_at=None)
    through = _heard_through(now)
    due = (Message.objects.select_for_update(skip_locked=True)
           .filter(status__in=[*OPEN_STATUSES, Status.OBSERVED], deadline_at__lt=now)
           .order_by("deadline_at"))
    # The console's own work first, in a batch of its own: a backlog of other nodes' traffic
    # (monitor mode at a high rate, or the upgrade's old rows) must not hold it up. Traffic
    # between other nodes is judged only while the console hears the bus: its silence would
    # otherwise be counted as theirs, and raise their agents' alarms.
    rows = list(due.exclude(direction=Direction.OBSERVED)[:SWEEP_BATCH])
    if through is not None:
        rows += list(due.filter(direction=Direction.OBSERVED, deadline_at__lt=through)
                     [:SWEEP_BATCH])
    changes = []
    for row in rows:
        status, words = _deadline_words(row)
        # Deaf for this row: the console has no proof it heard up to its deadline.
        deaf = through is None or row.deadline_at > through
        if deaf and row.status in (Status.PUBLISHED, Status.ACKED, Status.OBSERVED):
            words += ("; the console could not hear the bus meanwhile, so the answer may "
                      "only be late (a late response still completes it)")
        changes.append(Change(pk=row.pk, to=status, allowed=frozenset({row.status}),
                              actor="sweeper", reason=words,
                              fields={"error": words, "finished_at": now, "held": False,
                                      "publish_at": None, "ack_deadline_at": None}))
    applied = changes_apply(changes, now=now)
    result.ended += len(applied.messages)
    return applied.events


def deliveries_sweep(*, now: datetime | None = None) -> SweepResult:
    """Short transactions, each committing on its own: a long one would hold message and
    agent locks that the bridge needs."""
    now = now or timezone.now()
    result = SweepResult()
    for step in (_overdue, _due_attempts, _release_held, _past_deadline):
        if step is _due_attempts:
            part = _due_attempts(now)
        else:
            # A step retried after a deadlock starts from a fresh tally.
            part = atomic_retrying(lambda step=step: _run_step(step, now))
        result.retrying += part.retrying
        result.given_up += part.given_up
        result.attempts += part.attempts
        result.released += part.released
        result.ended += part.ended
        result.publish += part.publish
    return result


def _run_step(step, now: datetime) -> SweepResult:
    part = SweepResult()
    events_on_commit(step(now, part))
    if part.publish:
        outbox_wake()
    return part


def _release_held(now: datetime, result: SweepResult) -> list[dict]:
    publish, undeliverable = held_release(agent_ids=loads_to_release(), now=now)
    result.released += len(publish)
    result.publish += publish
    return changes_apply(undeliverable, now=now).events


PRUNE_BATCH = 2000
# Seconds of one prune call: beat calls it each minute, so it may take a third of a worker
# process's time while a backlog lasts, and the rate it keeps up with is what it deletes in
# that third (docs/performance.md, "Retention at a million rows").
PRUNE_BUDGET_S = 20.0


def messages_prune(*, now: datetime | None = None, max_batches: int | None = None,
                   budget_s: float = PRUNE_BUDGET_S) -> int:
    """Delete messages (and their transitions) older than REACH_RETENTION_DAYS, oldest
    first, a batch of PRUNE_BATCH a transaction along the created_at index, until none is
    due or `budget_s` is spent (or `max_batches`). Returns how many went; says in the log
    when the retention is behind after the call.

    Plain DELETEs by primary key, not Django's delete collector: the rows' only dependants
    are their transitions (deleted first, by their message index) and the resends that
    point at them (unlinked), so there is nothing for the collector to find, and it cost
    a query per relation per batch.

    A partitioned history (messages/partitions.py) loses its rows a partition at a time,
    whole; what this deletes there is only the table the migration found (the first
    partition, from MINVALUE), until it is past the retention and dropped in its turn."""
    days = settings.REACH_RETENTION_DAYS
    if days <= 0:
        return 0
    cutoff = (now or timezone.now()) - timedelta(days=days)
    stop_at = time.monotonic() + budget_s
    # Never what is still under way, whatever a short retention says: the outbox's rows and
    # open requests (their deadline ends them, and the next call takes them).
    due = Message.objects.filter(_settled(), created_at__lt=cutoff).order_by("created_at", "id")
    if history_partitioned():
        legacy = legacy_end()
        # pk below the migration's table's bound: the plan reads that partition only.
        due = due.filter(pk__lt=legacy) if legacy is not None else due.none()

    def delete(pks: list[int]) -> int:
        Message.objects.filter(resend_of__in=pks).update(resend_of=None)
        _delete_by_pk(Transition._meta.db_table, "message_id", pks)
        return _delete_by_pk(Message._meta.db_table, "id", pks)

    deleted, more = _in_batches(due, delete, stop_at=stop_at, max_batches=max_batches)
    # Tasks go with their rows: one whose last change is past the retention has none left
    # (its rows were written by then), and its list entry would lead to an empty trace.
    # Oldest first along the task list's created_at index: a task began before it ended.
    stale = (Task.objects.filter(created_at__lt=cutoff, updated_at__lt=cutoff)
             .order_by("created_at", "id"))
    _in_batches(stale, lambda pks: _delete_by_pk(Task._meta.db_table, "id", pks),
                stop_at=stop_at)
    behind = retention_behind_s(now=now) if more else 0.0
    if behind:
        log.warning("retention is behind: the oldest message is %.1f h past "
                    "REACH_RETENTION_DAYS=%g; this call deleted %d in %.0f s (the next "
                    "goes on in a minute)", behind / 3600, days, deleted, budget_s)
    return deleted


def _in_batches(due: QuerySet, act: Callable[[list[int]], int], *, stop_at: float,
                max_batches: int | None = None) -> tuple[int, bool]:
    """The housekeeping loop of the prune and the payload drop: take the first PRUNE_BATCH
    keys of `due`, `act` on them in one transaction, and again until a batch comes short,
    `max_batches` are done or the clock passes `stop_at` (one batch at least). Returns what
    `act` counted, and whether more may be due (the call stopped early)."""
    done = batches = 0
    while True:
        batches += 1
        with transaction.atomic():
            pks = list(due.values_list("pk", flat=True)[:PRUNE_BATCH])
            if not pks:
                return done, False
            done += act(pks)
        if len(pks) < PRUNE_BATCH:
            return done, False
        if time.monotonic() >= stop_at or (max_batches is not None and batches >= max_batches):
            return done, True


def _delete_by_pk(table: str, column: str, keys: list[int]) -> int:
    placeholders = ", ".join(["%s"] * len(keys))
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {table} WHERE {column} IN ({placeholders})", keys)  # noqa: S608 - names are the models' own
        return cursor.rowcount


def _settled() -> Q:
    """Rows nothing will send or retry any more: not in the outbox (SENT), and not a request
    still open (a retry copies its payload; its deadline ends it)."""
    open_request = Q(message_type=MessageType.TASK_REQUEST, status__in=OPEN_STATUSES)
    return ~Q(status=Status.SENT) & ~open_request


# The payloads that are content: a task's request and its response. The others (an ACK's
# duplicate flag, a NACK's reason, a CANCEL's ids) are the protocol's own words, read by the
# numbers' rebuild (messages/rollups.py) and kept with their rows.
CONTENT_TYPES = (MessageType.TASK_REQUEST, MessageType.TASK_RESPONSE)
# Seconds of one drop call, beside the prune's in the same minute of a worker process.
DROP_BUDGET_S = 10.0


def payloads_due(*, now: datetime) -> QuerySet[Message]:
    """The rows whose payload is due to go, oldest change first: content, settled, unchanged
    for REACH_PAYLOAD_KEEP_HOURS, past their task's deadline (a late retryable NACK may still
    ask for another attempt until then), and not yet due to the retention prune, which takes
    the whole row anyway."""
    due = Message.objects.filter(
        _settled(), Q(deadline_at__isnull=True) | Q(deadline_at__lte=now),
        payload__isnull=False, message_type__in=CONTENT_TYPES,
        updated_at__lt=now - timedelta(hours=settings.REACH_PAYLOAD_KEEP_HOURS))
    if settings.REACH_RETENTION_DAYS > 0:
        due = due.filter(created_at__gte=now - timedelta(days=settings.REACH_RETENTION_DAYS))
    return due.order_by("updated_at")


def payloads_drop(*, now: datetime | None = None, max_batches: int | None = None,
                  budget_s: float = DROP_BUDGET_S) -> int:
    """Drop the payloads kept past REACH_PAYLOAD_KEEP_HOURS (`payloads_due`): the column goes
    to NULL and `payload_dropped_at` says when, so the trace and the API can say so; status,
    times, transitions and outcome stay. Oldest change first along `a2a_payload_kept`, a batch
    a statement, until none is due or `budget_s` is spent. Returns how many payloads went."""
    if settings.REACH_PAYLOAD_KEEP_HOURS <= 0:
        return 0
    now = now or timezone.now()
    due = payloads_due(now=now)
    # The same conditions again in the UPDATE: a row that changed since it was read (a late
    # answer moves updated_at) keeps its payload until it is due again.
    dropped, more = _in_batches(
        due, lambda pks: due.filter(pk__in=pks).update(payload=None, payload_dropped_at=now),
        stop_at=time.monotonic() + budget_s, max_batches=max_batches)
    if more:
        log.warning("the payload drop is behind: %d dropped in %.0f s and more are due "
                    "(the next call goes on in a minute)", dropped, budget_s)
    return dropped
