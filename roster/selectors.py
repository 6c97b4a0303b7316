"""Reads of the roster that are more than a filter: the pages and the API share them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Count, Q, QuerySet
from django.utils import timezone

from roster.hearing import bus_heard_since
from roster.models import Agent, ClusterNode, RosterEvent, stale_cutoff

STATUS_STALE = "STALE"


@dataclass(frozen=True, slots=True)
class AgentFilter:
    namespace: str = ""
    node_id: str = ""
    capability: str = ""
    status: str = ""  # ONLINE, DRAINING, OFFLINE, or STALE
    q: str = ""
    stale: bool | None = None

    def as_query(self) -> dict[str, str]:
        values = {
            "namespace": self.namespace, "node": self.node_id, "capability": self.capability,
            "status": self.status, "q": self.q,
        }
        return {key: value for key, value in values.items() if value}


def _stale_q(now: datetime) -> Q:
    # Mirrors Agent.is_stale() so the filter and the badge always agree.
    cutoff = stale_cutoff(now, bus_heard_since(now=now))
    if cutoff is None:
        return Q(pk__in=[])  # the console has not heard the bus long enough to judge
    return ~Q(status=Agent.Status.OFFLINE) & (
        Q(last_heartbeat_at__lt=cutoff)
        | Q(last_heartbeat_at__isnull=True, registered_at__lt=cutoff)
    )


def agents_filter(flt: AgentFilter, *, now: datetime | None = None) -> QuerySet[Agent]:
    now = now or timezone.now()
    qs = Agent.objects.select_related("namespace", "node")
    if flt.namespace:
        qs = qs.filter(namespace__name=flt.namespace)
    if flt.node_id:
        qs = qs.filter(node__node_id=flt.node_id)
    if flt.capability:
        # The list is stored as JSON text on every backend; quoting the name matches one
        # whole element, not a substring of another capability.
        qs = qs.filter(capabilities__icontains=json.dumps(flt.capability))
    if flt.status == STATUS_STALE:
        qs = qs.filter(_stale_q(now))
    elif flt.status:
        qs = qs.filter(status=flt.status)
    if flt.stale is True:
        qs = qs.filter(_stale_q(now))
    elif flt.stale is False:
        qs = qs.exclude(_stale_q(now))
    if flt.q:
        qs = qs.filter(
            Q(agent_id__icontains=flt.q) | Q(node__node_id__icontains=flt.q)
            | Q(capabilities__icontains=flt.q) | Q(groups__icontains=flt.q)
        )
    return qs.order_by("agent_id")


@dataclass(frozen=True, slots=True)
class RosterCounts:
    online: int
    draining: int
    offline: int
    stale: int
    expired_last_hour: int


def roster_counts(*, now: datetime | None = None) -> RosterCounts:
    now = now or timezone.now()
    by_status = Agent.objects.aggregate(
        online=Count("id", filter=Q(status=Agent.Status.ONLINE)),
        draining=Count("id", filter=Q(status=Agent.Status.DRAINING)),
        offline=Count("id", filter=Q(status=Agent.Status.OFFLINE)),
        stale=Count("id", filter=_stale_q(now)),
    )
    expired = RosterEvent.objects.filter(
        kind__in=[RosterEvent.Kind.EXPIRED, RosterEvent.Kind.REMOVED],
        at__gte=now - timedelta(hours=1),
    ).count()
    return RosterCounts(expired_last_hour=expired, **by_status)


def filter_choices() -> dict[str, list[str]]:
    """Values for the filter drop-downs: what exists now, not a fixed list."""
    return {
        "namespaces": list(
            Agent.objects.order_by().values_list("namespace__name", flat=True).distinct()
        ),
        "nodes": list(ClusterNode.objects.values_list("node_id", flat=True)),
        "statuses": [*Agent.Status.values, STATUS_STALE],
    }


def nodes_with_agents() -> QuerySet[ClusterNode]:
    return ClusterNode.objects.annotate(
        agent_count=Count("agents"),
        online_count=Count("agents", filter=Q(agents__status=Agent.Status.ONLINE)),
    ).order_by("node_id")
