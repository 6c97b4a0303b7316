"""Thin periodic task: the service guards its own claims (two at once change nothing twice)."""

from __future__ import annotations

from celery import shared_task


@shared_task(name="alarms.tasks.alarms_evaluate", ignore_result=True)
def alarms_evaluate() -> dict[str, int]:
    from alarms.evaluate import alarms_evaluate as evaluate

    return evaluate().as_dict()
