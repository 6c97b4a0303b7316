"""Roster pages: health, one agent, the cluster's nodes. Short views; services do the work."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required, permission_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.utils.http import urlencode
from django.views.decorators.http import require_GET, require_POST
from django.views.decorators.vary import vary_on_headers

from reachconsole.core.audit import audit_record
from reachconsole.core.broker_drops import broker_drops_read
from roster import services
from roster.errors import RosterError
from roster.loads import LOAD_MEANING, agents_load
from roster.models import Agent, ClusterNode, Dialect, Reconciliation, RosterEvent
from roster.profile import card_shown
from roster.reconcile import cluster_reconcile, last_reconciliation
from roster.selectors import (
    AgentFilter,
    AgentPage,
    agents_filter,
    agents_page,
    filter_choices,
    node_counts,
    node_problems,
    recent_conflicts,
    roster_counts,
)

PAGE_SIZE = 100
PROBLEMS_PER_NODE = 10


def _filter_from(request: HttpRequest) -> AgentFilter:
    get = request.GET
    status = get.get("status", "")
    if status not in filter_choices()["statuses"]:
        status = ""
    dialect = get.get("dialect", "")
    return AgentFilter(
        namespace=get.get("namespace", "").strip(), node_id=get.get("node", "").strip(),
        capability=get.get("capability", "").strip(), status=status, q=get.get("q", "").strip(),
        dialect=dialect if dialect in Dialect.values else "",
    )


class RosterNumbers(Protocol):
    """Numbers about agents that another part of the console keeps (success rate, answer
    times: the messages app's). The composition root hands one to the roster page
    (reachconsole/urls.py, reachconsole/roster_numbers.py), so the page shows them and sorts
    the whole roster by them while roster imports no app."""

    window_label: str  # as the column headers say it: "15 m"
    window_minutes: int  # the task list's `since` for it
    sorts: dict[str, str]  # ?sort= value → how the page says it ("by success rate, …")
    first_direction: dict[str, str]  # column → the sort its first click asks for

    def allowed(self, user) -> bool: ...

    def cells(self, agent_ids: list[str], *, now: datetime) -> dict[str, Any]: ...

    def agents_page(self, flt: AgentFilter, *, sort: str, after: str, size: int,
                    now: datetime) -> tuple[AgentPage, dict[str, Any]]: ...


def _sort_links(numbers: RosterNumbers, query: dict[str, str], sort: str) -> dict[str, dict]:
    """Per column: the query its header link asks for (the first direction, or the other one
    when it is the current sort) and how the page is ordered by it now."""
    links = {}
    for column, first in numbers.first_direction.items():
        other = first.removeprefix("-") if first.startswith("-") else f"-{first}"
        current = sort.removeprefix("-") == column
        links[column] = {
            "query": urlencode({**query, "sort": other if sort == first else first}),
            "order": ("descending" if sort.startswith("-") else "ascending") if current else "",
        }
    return links


@require_GET
@login_required
@vary_on_headers("HX-Request")
def health(request: HttpRequest, numbers: RosterNumbers | None = None) -> HttpResponse:
    flt = _filter_from(request)
    now = timezone.now()
    after = request.GET.get("after", "")[:300]
    shown = numbers if numbers is not None and numbers.allowed(request.user) else None
    sort = request.GET.get("sort", "")
    if shown is None or sort not in shown.sorts:
        sort = ""
    if sort:
        page, cells = shown.agents_page(flt, sort=sort, after=after, size=PAGE_SIZE, now=now)
    else:
        page = agents_page(flt, after=after, size=PAGE_SIZE, now=now)
        cells = shown.cells([a.agent_id for a in page.agents], now=now) if shown else {}
    loads = agents_load(page.agents)
    for agent in page.agents:
        agent.load = loads[agent.agent_id]
        agent.numbers = cells.get(agent.agent_id)
    query = flt.as_query()
    paging = {**query, "sort": sort} if sort else query
    context = {
        "broker_drops": broker_drops_read(),
        "agents": page.agents, "total": agents_filter(flt, now=now).count(),
        "after": after, "after_query": urlencode({"after": after}),
        "next_query": urlencode({**paging, "after": page.next_cursor}) if page.next_cursor
        else "", "first_query": urlencode(paging),
        "counts": roster_counts(now=now), "flt": flt, "query": query,
        "choices": filter_choices(), "now": now, "load_meaning": LOAD_MEANING,
        "numbers": shown is not None, "sort": sort,
        "numbers_window": shown.window_label if shown else "",
        "numbers_minutes": shown.window_minutes if shown else 0,
        "sort_words": shown.sorts[sort] if sort else "",
        "sort_links": _sort_links(shown, query, sort) if shown else {},
        "unsorted_query": urlencode(query),
    }
    if request.htmx and request.htmx.target == "roster-live":
        return render(request, "roster/_health_live.html", context)
    return render(request, "roster/health.html", context)


@require_GET
@login_required
def agent_detail(request: HttpRequest, agent_id: str) -> HttpResponse:
    agent = get_object_or_404(Agent.objects.select_related("node", "namespace"), agent_id=agent_id)
    events = RosterEvent.objects.filter(agent_id=agent.agent_id)[:50]
    can_drain = request.user.has_perm("roster.change_agent")
    now = timezone.now()
    conflicts = {c for found in recent_conflicts(now=now, agent_id=agent.agent_id).values()
                 for c in found}
    return render(request, "roster/agent_detail.html", {
        "agent": agent, "events": events, "can_drain": can_drain, "now": now,
        "conflicts": sorted(conflicts, key=lambda c: c.claimed_by),
        "card": card_shown(agent.card) if agent.card else None,
    })


def _agent_action(request: HttpRequest, agent_id: str, action: str) -> HttpResponse:
    actor = request.user.get_username()
    try:
        if action == "drain":
            services.agent_drain(agent_id=agent_id, actor=actor)
            messages.success(request, f"{agent_id} is draining: no new work is routed to it; "
                             "work already accepted for it (in flight, held, retrying) "
                             "finishes on it while its lease holds.")
            return redirect("roster:agent", agent_id=agent_id)
        if action == "undrain":
            services.agent_undrain(agent_id=agent_id, actor=actor)
            messages.success(request, f"{agent_id} takes new work again.")
            return redirect("roster:agent", agent_id=agent_id)
        node_id = services.agent_deregister(agent_id=agent_id, actor=actor)
        messages.success(request, f"{agent_id} was deregistered from node {node_id}.")
        return redirect("roster:health")
    except RosterError as exc:
        # The service audits what it did, in its transaction; a refusal changed nothing and
        # is audited here.
        audit_record(actor=actor, action=action, target=agent_id, result="refused",
                     detail=exc.detail)
        if action == "undrain":
            # An agent gone from the roster (its lease lapsed while draining: phase 2) has no
            # page to go back to: the answer is the refusal itself, with its status.
            return render(request, "errors/error.html", {
                "status": exc.status, "detail": exc.detail,
                "title": "Not on the roster" if exc.status == 404 else "Not undrained",
            }, status=exc.status)
        messages.error(request, exc.detail)
        return redirect("roster:health")


@require_POST
@login_required
@permission_required("roster.change_agent", raise_exception=True)
def agent_drain(request: HttpRequest, agent_id: str) -> HttpResponse:
    return _agent_action(request, agent_id, "drain")


@require_POST
@login_required
@permission_required("roster.change_agent", raise_exception=True)
def agent_undrain(request: HttpRequest, agent_id: str) -> HttpResponse:
    return _agent_action(request, agent_id, "undrain")


@require_POST
@login_required
@permission_required("roster.change_agent", raise_exception=True)
def agent_deregister(request: HttpRequest, agent_id: str) -> HttpResponse:
    return _agent_action(request, agent_id, "deregister")


@require_GET
@login_required
@vary_on_headers("HX-Request")
def nodes(request: HttpRequest) -> HttpResponse:
    # Summaries, not every agent: counts per node and the first problem rows, so the page
    # and its poll cost the same for a hundred agents or tens of thousands.
    now = timezone.now()
    node_list = list(ClusterNode.objects.order_by("node_id"))
    counts = node_counts()
    problems = node_problems(now=now, per_node=PROBLEMS_PER_NODE)
    conflicts = recent_conflicts(now=now)
    for node in node_list:
        by_status = counts.get(node.pk, {})
        node.agent_count = sum(by_status.values())
        node.online_count = by_status.get(Agent.Status.ONLINE, 0)
        node.draining_count = by_status.get(Agent.Status.DRAINING, 0)
        node.offline_count = by_status.get(Agent.Status.OFFLINE, 0)
        node.problems = problems.get(node.pk)
        node.conflicts = conflicts.get(node.node_id, [])
    context = {
        "nodes": node_list, "now": now, "run": last_reconciliation(),
        "can_reconcile": request.user.has_perm("roster.reconcile_cluster"),
        "can_manage": request.user.has_perm("roster.manage_node"),
        # What a node's signing means here (messages/signing.py): whether the console checks
        # signatures at all, and whether it refuses unsigned traffic.
        "signing_keys": bool(settings.REACH_SIGNING_KEYS.strip()),
        "signing_strict": settings.REACH_REQUIRE_SIGNED,
        "console_node": settings.REACH_NODE_ID,  # its traffic is the console's own
    }
    if request.htmx and request.htmx.target == "nodes-live":
        return render(request, "roster/_nodes_live.html", context)
    return render(request, "roster/nodes.html", context)


@require_POST
@login_required
@permission_required("roster.reconcile_cluster", raise_exception=True)
def cluster_reconcile_now(request: HttpRequest) -> HttpResponse:
    run = cluster_reconcile(trigger=Reconciliation.Trigger.OPERATOR,
                            actor=request.user.get_username())
    changed = f"{len(run.changes)} node{'s' if len(run.changes) != 1 else ''} changed class"
    if run.authority_ok:
        messages.success(request, f"Reconciled against {run.authority} in {run.duration_ms} ms: "
                         f"{changed}.")
    else:
        messages.error(request, f"{run.detail}: every node is UNKNOWN until it answers "
                       f"({run.authority}); nothing was marked STALE.")
    return redirect("roster:nodes")


@require_POST
@login_required
@permission_required("roster.manage_node", raise_exception=True)
def node_drain(request: HttpRequest, node_id: str) -> HttpResponse:
    """Phase 1 for every agent on the node: no new work from now on; each leaves when its
    lease lapses (or is deregistered)."""
    return _node_action(request, node_id, "drain-node")


@require_POST
@login_required
@permission_required("roster.manage_node", raise_exception=True)
def node_retire(request: HttpRequest, node_id: str) -> HttpResponse:
    retire = request.POST.get("retired", "1") != "0"
    return _node_action(request, node_id, "retire-node" if retire else "unretire-node")


def _node_action(request: HttpRequest, node_id: str, action: str) -> HttpResponse:
    actor = request.user.get_username()
    try:
        if action == "drain-node":
            drained = services.node_drain(node_id=node_id, actor=actor)
            messages.success(request, f"Node {node_id}: {len(drained)} agent(s) now draining; "
                             "work already accepted for them (in flight, held, retrying) "
                             "finishes on them while their leases hold.")
        else:
            retire = action == "retire-node"
            services.node_retire(node_id=node_id, retired=retire, actor=actor)
            messages.success(request, f"Node {node_id} is retired: its agents get no new work."
                             if retire else f"Node {node_id} is back in service.")
    except RosterError as exc:
        # The service audits what it did, in its transaction; a refusal changed nothing and
        # is audited here.
        audit_record(actor=actor, action=action, target=node_id, result="refused",
                     detail=exc.detail)
        messages.error(request, exc.detail)
    return redirect("roster:nodes")
