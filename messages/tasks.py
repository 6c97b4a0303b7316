"""Thin tasks: ids in, a service or the bridge does the work."""

from __future__ import annotations

from celery import shared_task

from messages import runtime


@shared_task(name="messages.tasks.messages_publish", ignore_result=True, acks_late=True,
             autoretry_for=(LookupError,), retry_backoff=True, max_retries=20)
def messages_publish(pks: list[int]) -> int:
    """Hand SENT rows to this worker's bridge; a worker without one (REACH_BRIDGE=0) lets
    another take the task."""
    bridge = runtime.current_bridge()
    if bridge is None:
        raise LookupError("no MQTT bridge runs in this worker")
    bridge.submit(pks)
    return len(pks)


@shared_task(name="messages.tasks.deliveries_sweep", ignore_result=True)
def deliveries_sweep() -> dict[str, int]:
    from messages.sweeps import deliveries_sweep as sweep

    result = sweep()
    return {"retrying": result.retrying, "given_up": result.given_up,
            "attempts": result.attempts, "released": result.released}


@shared_task(name="messages.tasks.messages_prune", ignore_result=True)
def messages_prune() -> int:
    from messages.sweeps import messages_prune as prune

    return prune()
