"""Roster pages: health, one agent, the cluster's nodes. Short views; services do the work."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required, permission_required
from django.core.cache import cache
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST
from django.views.decorators.vary import vary_on_headers

from reachconsole.core.audit import audit_record
from roster import services
from roster.errors import RosterError
from roster.models import Agent, RosterEvent
from roster.selectors import (
    AgentFilter,
    agents_filter,
    filter_choices,
    nodes_with_agents,
    roster_counts,
)

PAGE_SIZE = 500


def _filter_from(request: HttpRequest) -> AgentFilter:
    get = request.GET
    status = get.get("status", "")
    if status not in filter_choices()["statuses"]:
        status = ""
    return AgentFilter(
        namespace=get.get("namespace", "").strip(), node_id=get.get("node", "").strip(),
        capability=get.get("capability", "").strip(), status=status, q=get.get("q", "").strip(),
    )


@require_GET
@login_required
@vary_on_headers("HX-Request")
def health(request: HttpRequest) -> HttpResponse:
    flt = _filter_from(request)
    now = timezone.now()
    agents = agents_filter(flt, now=now)
    total = agents.count()
    context = {
        # Written by the MQTT bridge (messages app) when the broker reports dropped messages.
        "broker_drops": cache.get("broker-drops"),
        "agents": agents[:PAGE_SIZE], "total": total, "shown": min(total, PAGE_SIZE),
        "counts": roster_counts(now=now), "flt": flt, "query": flt.as_query(),
        "choices": filter_choices(), "now": now,
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
    return render(request, "roster/agent_detail.html", {
        "agent": agent, "events": events, "can_drain": can_drain, "now": timezone.now(),
    })


def _agent_action(request: HttpRequest, agent_id: str, action: str) -> HttpResponse:
    actor = request.user.get_username()
    try:
        if action == "drain":
            services.agent_drain(agent_id=agent_id, actor=actor)
            messages.success(request, f"{agent_id} is draining: no new work is routed to it.")
            return redirect("roster:agent", agent_id=agent_id)
        node_id = services.agent_deregister(agent_id=agent_id, actor=actor)
        messages.success(request, f"{agent_id} was deregistered from node {node_id}.")
        return redirect("roster:health")
    except RosterError as exc:
        # The service audits what it did, in its transaction; a refusal changed nothing and
        # is audited here.
        audit_record(actor=actor, action=action, target=agent_id, result="refused",
                     detail=exc.detail)
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
def agent_deregister(request: HttpRequest, agent_id: str) -> HttpResponse:
    return _agent_action(request, agent_id, "deregister")


@require_GET
@login_required
@vary_on_headers("HX-Request")
def nodes(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    node_list = list(nodes_with_agents())
    by_node: dict[int, list[Agent]] = {}
    for agent in Agent.objects.select_related("node").order_by("agent_id"):
        by_node.setdefault(agent.node_id, []).append(agent)
    for node in node_list:
        node.agent_list = by_node.get(node.pk, [])
    context = {"nodes": node_list, "now": now}
    if request.htmx and request.htmx.target == "nodes-live":
        return render(request, "roster/_nodes_live.html", context)
    return render(request, "roster/nodes.html", context)
