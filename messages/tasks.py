"""Thin tasks: a service does the work. Publishing is no task: bridges claim due rows from
the outbox themselves (messages/outbox.py), whatever Celery pool runs them."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="messages.tasks.deliveries_sweep", ignore_result=True)
def deliveries_sweep() -> dict[str, int]:
    from messages.sweeps import deliveries_sweep as sweep

    result = sweep()
    return {"retrying": result.retrying, "given_up": result.given_up,
            "attempts": result.attempts, "released": result.released,
            "ended": result.ended}


@shared_task(name="messages.tasks.messages_prune", ignore_result=True)
def messages_prune() -> int:
    from messages.sweeps import messages_prune as prune

    return prune()


@shared_task(name="messages.tasks.partitions_maintain", ignore_result=True)
def partitions_maintain() -> dict[str, int]:
    from django.utils import timezone

    from messages.partitions import partitions_maintain as maintain

    return maintain(now=timezone.now())


@shared_task(name="messages.tasks.payloads_drop", ignore_result=True)
def payloads_drop() -> int:
    from messages.sweeps import payloads_drop as drop

    return drop()


@shared_task(name="messages.tasks.loads_reconcile", ignore_result=True)
def loads_reconcile() -> int:
    from messages.backpressure import loads_reconcile as reconcile

    return reconcile()


@shared_task(name="messages.tasks.rollups_fold", ignore_result=True)
def rollups_fold() -> int:
    import time

    from messages.rollups import FOLD_BATCH
    from messages.rollups import rollups_fold as fold

    # Batch after batch while a backlog remains, within a few seconds: beat runs it again.
    started, read = time.monotonic(), 0
    while True:
        done = fold().read
        read += done
        if done < FOLD_BATCH or time.monotonic() - started > 5:
            return read
