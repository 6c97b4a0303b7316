"""Reads of the roster that are more than a filter: the pages and the API share them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Case, Count, F, IntegerField, Q, QuerySet, Value, When, Window
from django.db.models.functions import RowNumber
from django.utils import timezone

from roster.hearing import bus_hearing, node_down_after
from roster.models import Agent, ClusterNode, Consistency, Dialect, RosterEvent, stale_cutoff

# Each heartbeat that lists a misplaced agent writes one event: the newest few thousand are
# plenty to show which conflicts are current.
MAX_CONFLICTS = 2000

STATUS_STALE = "STALE"


@dataclass(frozen=True, slots=True)
class AgentFilter:
    namespace: str = ""
    node_id: str = ""
    capability: str = ""
    status: str = ""  # ONLINE, DRAINING, OFFLINE, or STALE
    q: str = ""
    stale: bool | None = None
    dialect: str = ""  # native or a2a-mqtt (roster/profile.py)

    def as_query(self) -> dict[str, str]:
        values = {
            "namespace": self.namespace, "node": self.node_id, "capability": self.capability,
            "status": self.status, "q": self.q, "dialect": self.dialect,
        }
        return {key: value for key, value in values.items() if value}


def _stale_q(now: datetime) -> Q:
    # Mirrors Agent.is_stale() so the filter and the badge always agree.
    # A profile agent is never stale: its presence is its card's (roster/profile.py).
    on_stale_node = Q(node__consistency=Consistency.STALE, dialect=Dialect.NATIVE)
    cutoff = stale_cutoff(bus_hearing(now=now))
    if cutoff is None:
        # The console has not heard the bus long enough to judge heartbeats; what
        # reconciliation found of a node does not depend on that.
        return ~Q(status=Agent.Status.OFFLINE) & on_stale_node
    return ~Q(status=Agent.Status.OFFLINE) & (
        on_stale_node
        | Q(dialect=Dialect.NATIVE) & (
            Q(last_heartbeat_at__lt=cutoff)
            | Q(last_heartbeat_at__isnull=True, registered_at__lt=cutoff))
    )


def agents_filter(flt: AgentFilter, *, now: datetime | None = None) -> QuerySet[Agent]:
    now = now or timezone.now()
    qs = Agent.objects.select_related("namespace", "node")
    if flt.namespace:
        qs = qs.filter(namespace__name=flt.namespace)
    if flt.node_id:
        qs = qs.filter(node__node_id=flt.node_id)
    if flt.dialect:
        qs = qs.filter(dialect=flt.dialect)
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


def _problem_q(now: datetime) -> Q:
    """Agents that need attention: not ONLINE, or ONLINE and stale. No index serves it:
    an index on status would cost the lease sweep its HOT update (roster.models.Agent.Meta),
    and at 10,000 agents the filter costs a page less than its template does
    (docs/performance.md, "The roster at scale")."""
    return (Q(status__in=[Agent.Status.DRAINING, Agent.Status.OFFLINE])
            | (Q(status=Agent.Status.ONLINE) & _stale_q(now)))


def _fine(now: datetime) -> Case:
    """1 for an agent that needs no attention (ONLINE and not stale), else 0: the problem
    rows sort first."""
    return Case(When(_problem_q(now), then=Value(0)), default=Value(1),
                output_field=IntegerField())


@dataclass(frozen=True, slots=True)
class AgentPage:
    agents: list[Agent]
    next_cursor: str  # "" on the last page


def agents_page(flt: AgentFilter, *, after: str = "", size: int = 100,
                now: datetime | None = None) -> AgentPage:
    """One page of the filtered roster, the problem rows first, then by agent id. Keyset
    paging: `after` is the cursor of the previous page, so a page never repeats or skips a
    row because others came or went before it (an agent whose own state changes between two
    pages may move to the other section)."""
    now = now or timezone.now()
    qs = agents_filter(flt, now=now).annotate(fine=_fine(now)).order_by("fine", "agent_id")
    fine, _, agent_id = after.partition("|")
    if fine in ("0", "1") and agent_id:
        qs = qs.filter(Q(fine__gt=int(fine)) | Q(fine=int(fine), agent_id__gt=agent_id))
    rows = list(qs[:size + 1])
    more = len(rows) > size
    last = rows[size - 1] if more else None
    return AgentPage(rows[:size], f"{last.fine}|{last.agent_id}" if last else "")


def node_counts() -> dict[int, dict[str, int]]:
    """Agents per node (by primary key) and status: one grouped read of the roster."""
    out: dict[int, dict[str, int]] = {}
    for node_pk, status, n in (Agent.objects.order_by().values_list("node_id", "status")
                               .annotate(n=Count("id"))):
        out.setdefault(node_pk, {})[status] = n
    return out


@dataclass(frozen=True, slots=True)
class NodeProblems:
    first: list[Agent]  # the first few, by agent id
    total: int


def node_problems(*, now: datetime | None = None, per_node: int = 10
                  ) -> dict[int, NodeProblems]:
    """Per node (by primary key): the agents that need attention (not ONLINE, or stale), the
    first few and how many in all. Two queries whatever the roster's size."""
    now = now or timezone.now()
    problems = Agent.objects.filter(_problem_q(now))
    totals = dict(problems.order_by().values_list("node_id").annotate(n=Count("id")))
    first: dict[int, list[Agent]] = {}
    rows = (problems.annotate(place=Window(RowNumber(), partition_by=[F("node_id")],
                                           order_by=F("agent_id").asc()))
            .filter(place__lte=per_node)
            .select_related("node")
            .only("agent_id", "status", "node_id", "last_heartbeat_at", "registered_at",
                  "dialect", "node__consistency")
            .order_by("node_id", "agent_id"))
    for agent in rows:
        first.setdefault(agent.node_id, []).append(agent)
    return {pk: NodeProblems(first.get(pk, []), total) for pk, total in totals.items()}


@dataclass(frozen=True, slots=True)
class RosterCounts:
    online: int
    draining: int
    offline: int
    stale: int
    expired_last_hour: int
    # Of the above, the agents of the A2A-over-MQTT profile (their presence is their card's).
    profile_online: int = 0
    profile_offline: int = 0


def roster_counts(*, now: datetime | None = None) -> RosterCounts:
    now = now or timezone.now()
    by_status = Agent.objects.aggregate(
        online=Count("id", filter=Q(status=Agent.Status.ONLINE)),
        draining=Count("id", filter=Q(status=Agent.Status.DRAINING)),
        offline=Count("id", filter=Q(status=Agent.Status.OFFLINE)),
        stale=Count("id", filter=_stale_q(now)),
        profile_online=Count("id", filter=Q(dialect=Dialect.A2A_MQTT,
                                            status=Agent.Status.ONLINE)),
        profile_offline=Count("id", filter=Q(dialect=Dialect.A2A_MQTT,
                                             status=Agent.Status.OFFLINE)),
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


def nodes_with_agents(*, namespaces: frozenset[str] | None = None) -> QuerySet[ClusterNode]:
    """Every node with its agent counts; with `namespaces` (a token bound to them), only the
    nodes that host an agent of those namespaces, counting only those agents."""
    if namespaces is None:
        return ClusterNode.objects.annotate(
            agent_count=Count("agents"),
            online_count=Count("agents", filter=Q(agents__status=Agent.Status.ONLINE)),
            draining_count=Count("agents", filter=Q(agents__status=Agent.Status.DRAINING)),
            offline_count=Count("agents", filter=Q(agents__status=Agent.Status.OFFLINE)),
        ).order_by("node_id")
    mine = Q(agents__namespace__name__in=namespaces)
    return ClusterNode.objects.annotate(
        agent_count=Count("agents", filter=mine),
        online_count=Count("agents", filter=mine & Q(agents__status=Agent.Status.ONLINE)),
        draining_count=Count("agents", filter=mine & Q(agents__status=Agent.Status.DRAINING)),
        offline_count=Count("agents", filter=mine & Q(agents__status=Agent.Status.OFFLINE)),
    ).filter(agent_count__gt=0).order_by("node_id")


@dataclass(frozen=True, slots=True)
class Conflict:
    """An agent listed in the heartbeats of a node the roster does not place it on."""

    agent_id: str
    claimed_by: str  # the node whose heartbeats list it
    placed_on: str  # the node the roster places it on ("" once it left the roster)
    at: datetime


def recent_conflicts(*, now: datetime | None = None,
                     agent_id: str | None = None) -> dict[str, list[Conflict]]:
    """Conflicts still current (reported within three heartbeat intervals), under both nodes
    involved: the one that lists the agent and the one the roster places it on."""
    now = now or timezone.now()
    events = RosterEvent.objects.filter(kind=RosterEvent.Kind.CONFLICT,
                                        at__gte=now - node_down_after(None))
    if agent_id is not None:
        events = events.filter(agent_id=agent_id)
    latest: dict[tuple[str, str], datetime] = {}
    for agent_id, node_id, at in (
        events.order_by("-at").values_list("agent_id", "node_id", "at")[:MAX_CONFLICTS]
    ):
        latest.setdefault((agent_id, node_id), at)
    placed = dict(Agent.objects.filter(agent_id__in={a for a, _ in latest})
                  .values_list("agent_id", "node__node_id"))
    out: dict[str, list[Conflict]] = {}
    for (agent_id, claimed_by), at in sorted(latest.items()):
        conflict = Conflict(agent_id, claimed_by, placed.get(agent_id, ""), at)
        for node_id in {claimed_by, conflict.placed_on} - {""}:
            out.setdefault(node_id, []).append(conflict)
    return out


@dataclass(frozen=True, slots=True)
class NodeSummary:
    """The cluster at a glance (the overview page)."""

    total: int
    online: int  # in service and heard within three heartbeat intervals
    down: int  # in service and silent
    registered: int  # in service, named by a registration and never heard
    retired: int  # taken out of service by an operator
    consistency: dict[str, int]  # what the last reconciliation said: OK, STALE, UNKNOWN
    # The first few that are down, never heard, STALE or retired, by node id.
    attention: list[ClusterNode]


def node_summary(*, attention: int = 10) -> NodeSummary:
    """Nodes by status and by class, and the first few that need attention: two reads,
    whatever the cluster's size."""
    in_service = Q(retired=False)
    counts = ClusterNode.objects.aggregate(
        total=Count("id"),
        online=Count("id", filter=in_service & Q(status=ClusterNode.Status.ONLINE)),
        down=Count("id", filter=in_service & Q(status=ClusterNode.Status.DOWN)),
        registered=Count("id", filter=in_service & Q(status=ClusterNode.Status.REGISTERED)),
        retired=Count("id", filter=Q(retired=True)),
        **{cls: Count("id", filter=Q(consistency=cls)) for cls in Consistency.values},
    )
    needs = (Q(retired=True)
             | Q(status__in=[ClusterNode.Status.DOWN, ClusterNode.Status.REGISTERED])
             | Q(consistency=Consistency.STALE))
    return NodeSummary(
        total=counts["total"], online=counts["online"], down=counts["down"],
        registered=counts["registered"], retired=counts["retired"],
        consistency={cls: counts[cls] for cls in Consistency.values},
        attention=list(ClusterNode.objects.filter(needs).order_by("node_id")[:attention]),
    )
