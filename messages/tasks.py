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


@shared_task(name="messages.tasks.loads_reconcile", ignore_result=True)
def loads_reconcile() -> int:
    from messages.load import loads_reconcile as reconcile

    return reconcile()
