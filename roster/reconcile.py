"""Reconcile the roster against the cluster's node set: is each agent's node really there?

The node set comes from the cluster's authority, `REACH_CLUSTER_NODES_URL` (an endpoint in
the shape of `GET /api/cluster/nodes`), when one is set, else from the console's own node
table and the heartbeats it heard. Each node, and so every agent the roster places on it, is

- OK: listed and live;
- STALE: the set is known and the node is not in it, or it is retired, reported down, or
  silent for three heartbeat intervals. Its agents get no new work until it returns;
- UNKNOWN: the authority could not be reached or answered nonsense, or nothing was ever
  heard of the node. Missing data never makes anything STALE.

A run stores its verdicts on the nodes (routing reads them) and one `Reconciliation` row
(pages and `GET /api/ops/roster-consistency` read it), so nobody recomputes per request.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from reachconsole.core.audit import audit_record
from roster.hearing import Hearing, bus_hearing, node_down_after, silence_words
from roster.models import (
    NODE_ID_RE,
    PROFILE_NODE_ID,
    Agent,
    ClusterNode,
    Consistency,
    Dialect,
    Reconciliation,
)

log = logging.getLogger(__name__)

ROSTER_AUTHORITY = "roster"
MAX_AUTHORITY_BYTES = 8 * 1024 * 1024
GONE_STATUSES = frozenset({"DOWN", "RETIRED", "SILENT", "OFFLINE"})
MAX_RECORDED_CHANGES = 500
QUIET_RUNS_KEPT = timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class NodeSet:
    """What the authority said: the nodes it lists (node id → its entry), or None when the
    console's own table is the set or the authority could not be used (`error` says why)."""

    source: str
    listed: dict[str, dict] | None = None
    error: str = ""


class Nonsense(ValueError):
    """The authority answered, but not with a node set the console can trust."""


def node_set_fetch(*, timeout_s: float) -> NodeSet:
    url = settings.REACH_CLUSTER_NODES_URL
    if not url:
        return NodeSet(ROSTER_AUTHORITY)
    headers = {"Accept": "application/json", "X-OODER-Source": settings.REACH_CLUSTER_NODES_SOURCE}
    if settings.REACH_CLUSTER_NODES_TOKEN:
        headers["Authorization"] = f"Bearer {settings.REACH_CLUSTER_NODES_TOKEN}"
    try:
        request = urllib.request.Request(url, headers=headers)  # noqa: S310 - an operator's URL
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            body = response.read(MAX_AUTHORITY_BYTES + 1)
        if len(body) > MAX_AUTHORITY_BYTES:
            raise Nonsense(f"the answer is over {MAX_AUTHORITY_BYTES // (1024 * 1024)} MB")
        return NodeSet(url, _listed(json.loads(body)))
    except urllib.error.HTTPError as exc:
        return NodeSet(url, error=f"the node authority answered HTTP {exc.code}")
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return NodeSet(url, error=f"the node authority could not be reached: {reason}")
    except (Nonsense, ValueError) as exc:  # JSON that does not parse is a ValueError too
        return NodeSet(url, error=f"the node authority answered nonsense: {str(exc)[:200]}")


def _listed(doc: object) -> dict[str, dict]:
    if not isinstance(doc, list):
        raise Nonsense(f"expected a JSON list of nodes, got {type(doc).__name__}")
    listed: dict[str, dict] = {}
    for index, entry in enumerate(doc):
        node_id = entry.get("nodeId") if isinstance(entry, dict) else None
        if not isinstance(node_id, str) or not NODE_ID_RE.fullmatch(node_id):
            raise Nonsense(f"entry {index} has no valid nodeId")
        status = entry.get("status")
        if status is not None and not isinstance(status, str):
            raise Nonsense(f"entry {index} ({node_id}) has a status that is not text")
        listed[node_id] = entry
    if not listed and Agent.objects.filter(dialect=Dialect.NATIVE).exists():
        # One bad deploy of the authority must not take every agent out of routing.
        raise Nonsense("an empty node set while the roster holds agents")
    return listed


def node_verdict(node: ClusterNode, node_set: NodeSet, *, now: datetime,
                 hearing: Hearing | None) -> tuple[str, str]:
    """(class, reason) of one node: PROTOCOL.md "Console pages and operations"."""
    if node.retired:
        return Consistency.STALE, f"node {node.node_id} is retired"
    if node_set.error:
        return Consistency.UNKNOWN, node_set.error
    listed = node_set.listed
    if listed is not None:
        entry = listed.get(node.node_id)
        if entry is None:
            return Consistency.STALE, f"node {node.node_id} is not in the cluster's node set"
        status = str(entry.get("status") or "").upper()
        if entry.get("retired") is True or status in GONE_STATUSES:
            return Consistency.STALE, (f"the cluster's node set reports node {node.node_id} "
                                       f"{'RETIRED' if entry.get('retired') is True else status}")
    window = node_down_after(node.heartbeat_ms)
    silent_before = hearing.cutoff(window) if hearing is not None else None
    if node.last_seen_at is not None and silent_before is not None:
        if node.last_seen_at < silent_before:
            return Consistency.STALE, silence_words(node.node_id, node.last_seen_at,
                                                    now=hearing.through, window=window)
        if node.last_seen_at >= now - window:
            return Consistency.OK, f"node {node.node_id} is live"
    if listed is not None:
        return Consistency.OK, f"node {node.node_id} is listed by the cluster's node set"
    if node.last_seen_at is None:
        return Consistency.UNKNOWN, (f"node {node.node_id} has never sent a heartbeat; only a "
                                     "registration names it")
    return Consistency.UNKNOWN, ("the console has not heard the bus long enough to judge "
                                 f"node {node.node_id}'s silence")


def cluster_reconcile(*, trigger: str, actor: str = "", timeout_s: float | None = None,
                      now: datetime | None = None) -> Reconciliation:
    """Classify every node (and so every roster entry), store the verdicts and the run.
    Concurrent runs queue on the node rows, so a change is recorded once."""
    started = time.monotonic()
    timeout_s = settings.REACH_RECONCILE_TIMEOUT_S if timeout_s is None else timeout_s
    node_set = node_set_fetch(timeout_s=timeout_s)  # outside the transaction: it may be slow
    now = now or timezone.now()
    hearing = bus_hearing(now=now)
    with transaction.atomic():
        # The A2A-over-MQTT profile's node is no member of the cluster: its agents' presence
        # is their cards' (roster/profile.py), and it stays OK.
        nodes = list(ClusterNode.objects.select_for_update().exclude(node_id=PROFILE_NODE_ID)
                     .order_by("node_id"))
        changed, changes = [], []
        for node in nodes:
            verdict, reason = node_verdict(node, node_set, now=now, hearing=hearing)
            if verdict != node.consistency:
                changes.append({"nodeId": node.node_id, "from": node.consistency,
                                "to": verdict, "reason": reason})
            if (verdict, reason) != (node.consistency, node.consistency_reason):
                node.consistency, node.consistency_reason = verdict, reason[:300]
                changed.append(node)
        ClusterNode.objects.bulk_update(changed, ["consistency", "consistency_reason"])
        counts = Counter({c.value: 0 for c in Consistency})
        counts.update({row["node__consistency"]: row["n"] for row in
                       Agent.objects.values("node__consistency").annotate(n=Count("id"))})
        run = Reconciliation.objects.create(
            started_at=now, trigger=trigger, actor=actor[:150],
            authority=node_set.source[:500], authority_ok=not node_set.error,
            detail=node_set.error, counts=dict(counts),
            changes=changes[:MAX_RECORDED_CHANGES],
            duration_ms=int((time.monotonic() - started) * 1000),
        )
        _prune(now)
        if trigger == Reconciliation.Trigger.OPERATOR:
            audit_record(actor=actor or "operator", action="reconcile", target="cluster",
                         detail=_summary(run))
    if node_set.error:
        log.warning("reconciliation: %s (%s); nothing was marked STALE on its word",
                    node_set.error, node_set.source)
    for change in changes:
        log.info("reconciliation: node %s %s → %s: %s", change["nodeId"], change["from"],
                 change["to"], change["reason"])
    return run


def _prune(now: datetime) -> None:
    """Runs that changed nothing matter for an hour (when did it last run, how long did it
    take); runs that changed something as long as messages are kept."""
    Reconciliation.objects.filter(started_at__lt=now - QUIET_RUNS_KEPT, changes=[]).delete()
    if settings.REACH_RETENTION_DAYS:
        Reconciliation.objects.filter(
            started_at__lt=now - timedelta(days=settings.REACH_RETENTION_DAYS)).delete()


def _summary(run: Reconciliation) -> str:
    counts = ", ".join(f"{k} {v}" for k, v in sorted(run.counts.items()))
    moved = "; ".join(f"{c['nodeId']} {c['from']}→{c['to']}" for c in run.changes[:20])
    return (f"against {run.authority}: {counts}; {len(run.changes)} node(s) changed"
            + (f" ({moved})" if moved else "") + (f"; {run.detail}" if run.detail else ""))


def last_reconciliation() -> Reconciliation | None:
    return Reconciliation.objects.order_by("-started_at", "-id").first()


@dataclass(frozen=True, slots=True)
class ConsistencyRow:
    agent_id: str
    node_id: str
    agent_status: str
    consistency: str
    reason: str


def roster_consistency() -> list[ConsistencyRow]:
    """Every roster entry with its node's stored class, the problem rows first."""
    rows = Agent.objects.values_list("agent_id", "node__node_id", "status", "node__consistency",
                          "node__consistency_reason")
    order = {Consistency.STALE: 0, Consistency.UNKNOWN: 1, Consistency.OK: 2}
    out = [ConsistencyRow(*row) for row in rows.order_by("agent_id")]
    out.sort(key=lambda r: order.get(r.consistency, 3))
    return out
