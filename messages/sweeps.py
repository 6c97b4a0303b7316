"""The delivery sweep (Celery beat, every REACH_RETRY_SWEEP_S): overdue transmissions become
retries or end, due retries go out as new attempts, held messages get freed slots.

Every claim is `select_for_update(skip_locked=True)` plus a status-guarded change, so two
sweepers running at once never send the same attempt; a sweeper killed mid-claim rolls back
and the rows wait for the next sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from messages.delivery import ack_deadline, held_release, retry_or_give_up
from messages.events import events_on_commit
from messages.models import Direction, Message, Status, Transition
from messages.outbound import message_next_attempt, publish_request
from messages.state import Change, atomic_retrying, changes_apply

SWEEP_BATCH = 500


@dataclass
class SweepResult:
    retrying: int = 0
    given_up: int = 0
    attempts: int = 0
    released: int = 0
    publish: list[int] = field(default_factory=list)


def _overdue(now: datetime, result: SweepResult) -> list[dict]:
    rows = list(
        Message.objects.select_for_update(skip_locked=True)
        .filter(direction=Direction.SEND, message_type="TASK_REQUEST", held=False,
                status__in=[Status.SENT, Status.PUBLISHED], ack_deadline_at__lt=now)
        .order_by("ack_deadline_at")[:SWEEP_BATCH]
    )
    changes = []
    wait = settings.REACH_ACK_TIMEOUT_MS
    for row in rows:
        silence = (f"no ACK within {wait} ms" if row.status == Status.PUBLISHED
                   else f"the broker did not take it within {wait} ms")
        status, fields, why = retry_or_give_up(row, now=now)
        if status:
            changes.append(Change(pk=row.pk, to=status, allowed=frozenset({row.status}),
                                  actor="sweeper", reason=f"{silence}; {why}", fields=fields))
            result.retrying += 1
            continue
        # Never taken by the broker: a publish failure. Taken but never answered: expired.
        terminal = Status.EXPIRED if row.status == Status.PUBLISHED else Status.FAILED
        words = f"{silence} on attempt {row.attempt}, and no retry: {why}"
        changes.append(Change(pk=row.pk, to=terminal, allowed=frozenset({row.status}),
                              actor="sweeper", reason=words,
                              fields={"error": words, "finished_at": now}))
        result.given_up += 1
    return changes_apply(changes, now=now).events


def _due(now: datetime, result: SweepResult) -> list[dict]:
    rows = list(
        Message.objects.select_for_update(skip_locked=True)
        .filter(status=Status.RETRYING, next_attempt_at__lte=now)
        .order_by("next_attempt_at")[:SWEEP_BATCH]
    )
    events: list[dict] = []
    changes = []
    retrying = frozenset({Status.RETRYING})
    for row in rows:
        if row.deadline_at and row.deadline_at <= now:
            words = "the task's deadline (timeoutMs) passed before the next attempt"
            changes.append(Change(pk=row.pk, to=Status.EXPIRED, allowed=retrying,
                                  actor="sweeper", reason=words,
                                  fields={"error": words, "finished_at": now}))
            result.given_up += 1
            continue
        new, publish, more, why = message_next_attempt(previous=row, now=now)
        if new is None:
            terminal = Status.UNDELIVERABLE if "retry-storm" not in why else Status.EXPIRED
            words = f"attempt {row.attempt + 1} not made: {why}"
            changes.append(Change(pk=row.pk, to=terminal, allowed=retrying, actor="sweeper",
                                  reason=words, fields={"error": words, "finished_at": now}))
            result.given_up += 1
            continue
        events += more
        result.publish += publish
        result.attempts += 1
        changes.append(Change(pk=row.pk, to=Status.RETRIED, allowed=retrying, actor="sweeper",
                              reason=f"attempt {new.attempt} is {new.message_id}",
                              fields={"finished_at": now}))
    return events + changes_apply(changes, now=now).events


def deliveries_sweep(*, now: datetime | None = None) -> SweepResult:
    """Three short transactions, each committing (and publishing) on its own: a long one
    would hold message and agent locks that the bridge needs."""
    now = now or timezone.now()
    result = SweepResult()
    for step in (_overdue, _due, _release_held, _unpublished_replies):
        # A step retried after a deadlock starts from a fresh tally.
        part = atomic_retrying(lambda step=step: _run_step(step, now))
        result.retrying += part.retrying
        result.given_up += part.given_up
        result.attempts += part.attempts
        result.released += part.released
        result.publish += part.publish
    return result


def _run_step(step, now: datetime) -> SweepResult:
    part = SweepResult()
    events_on_commit(step(now, part))
    if part.publish:
        transaction.on_commit(lambda: publish_request(part.publish))
    return part


def _release_held(now: datetime, result: SweepResult) -> list[dict]:
    agents = list(Message.objects.filter(direction=Direction.SEND, held=True, status=Status.SENT)
                  .order_by().values_list("to_agent_id", flat=True).distinct()[:200])
    publish, undeliverable = held_release(agent_ids=agents, now=now)
    result.released += len(publish)
    result.publish += publish
    return changes_apply(undeliverable, now=now).events


def _unpublished_replies(now: datetime, result: SweepResult) -> list[dict]:
    """The console's own ACKs and responses that the broker never took (the worker died
    between commit and publish, or paho could not queue them): publish them again. A
    receiver treats a repeated answer as the same answer."""
    pks = list(
        Message.objects.select_for_update(skip_locked=True)
        .filter(direction=Direction.SEND, status=Status.SENT, ack_deadline_at__lt=now)
        .exclude(message_type="TASK_REQUEST")
        .order_by("ack_deadline_at").values_list("pk", flat=True)[:SWEEP_BATCH]
    )
    if pks:
        Message.objects.filter(pk__in=pks, status=Status.SENT).update(
            ack_deadline_at=ack_deadline(now))
        result.publish += pks
    return []


PRUNE_BATCH = 2000


def messages_prune(*, now: datetime | None = None, max_batches: int = 50) -> int:
    """Delete messages (and their transitions) older than REACH_RETENTION_DAYS, oldest
    first, a bounded batch at a time along the created_at index. Returns how many went."""
    days = settings.REACH_RETENTION_DAYS
    if days <= 0:
        return 0
    cutoff = (now or timezone.now()) - timedelta(days=days)
    deleted = 0
    for _ in range(max_batches):
        with transaction.atomic():
            pks = list(Message.objects.filter(created_at__lt=cutoff).order_by("created_at")
                       .values_list("pk", flat=True)[:PRUNE_BATCH])
            if not pks:
                break
            Message.objects.filter(resend_of__in=pks).update(resend_of=None)
            Transition.objects.filter(message_id__in=pks).delete()
            deleted += Message.objects.filter(pk__in=pks).delete()[1].get("a2a.Message", 0)
    return deleted
