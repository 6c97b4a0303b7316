"""Reconcile the roster against the node set: is each agent's node really there?

OK: the node sent a heartbeat (MQTT or HTTP) within a lease TTL.
STALE: the node is known but silent, or retired by an operator.
UNKNOWN: the node has never sent a heartbeat; only a registration names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from django.conf import settings
from django.utils import timezone

from roster.models import Agent, ClusterNode


class Consistency(StrEnum):
    OK = "OK"
    STALE = "STALE"
    UNKNOWN = "UNKNOWN"


@dataclass(frozen=True, slots=True)
class ConsistencyRow:
    agent_id: str
    node_id: str
    agent_status: str
    consistency: Consistency
    reason: str


def node_consistency(node: ClusterNode, *, now: datetime) -> tuple[Consistency, str]:
    if node.retired:
        return Consistency.STALE, f"node {node.node_id} is retired"
    if node.last_seen_at is None:
        return Consistency.UNKNOWN, f"node {node.node_id} has never sent a heartbeat"
    ttl = timedelta(milliseconds=settings.REACH_LEASE_TTL_MS)
    if not node.seen_within(ttl, now):
        age = int((now - node.last_seen_at).total_seconds())
        return Consistency.STALE, f"node {node.node_id} was last heard {age} s ago"
    return Consistency.OK, f"node {node.node_id} is live"


def roster_consistency(*, now: datetime | None = None) -> list[ConsistencyRow]:
    now = now or timezone.now()
    rows = []
    for agent in Agent.objects.select_related("node").order_by("agent_id"):
        consistency, reason = node_consistency(agent.node, now=now)
        rows.append(
            ConsistencyRow(
                agent_id=agent.agent_id, node_id=agent.node.node_id,
                agent_status=agent.status, consistency=consistency, reason=reason,
            )
        )
    return rows
