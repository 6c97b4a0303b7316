"""Thin periodic tasks: each calls one service, which guards its own claims."""

from __future__ import annotations

from celery import shared_task

from roster import reconcile, services
from roster.models import Reconciliation


@shared_task(name="roster.tasks.leases_expire", ignore_result=True)
def leases_expire() -> dict[str, int]:
    counts = services.leases_expire()
    return {"offline": counts.offline, "removed": counts.removed}


@shared_task(name="roster.tasks.lease_deadlines_repair", ignore_result=True)
def lease_deadlines_repair() -> int:
    return services.lease_deadlines_repair()


@shared_task(name="roster.tasks.nodes_sweep", ignore_result=True)
def nodes_sweep() -> int:
    return services.nodes_sweep()


@shared_task(name="roster.tasks.cluster_reconcile", ignore_result=True)
def cluster_reconcile() -> dict[str, int]:
    return reconcile.cluster_reconcile(trigger=Reconciliation.Trigger.SCHEDULE).counts
