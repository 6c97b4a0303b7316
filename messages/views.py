"""Message pages: the list an operator filters in an incident, one message's whole trace,
resend (one or a filtered set), and what an agent still has in flight before a drain."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required, permission_required
from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.template.defaultfilters import pluralize
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.views.decorators.http import require_GET, require_POST
from django.views.decorators.vary import vary_on_headers

from directory.routing import route_capability
from messages.models import Direction, Message, Status
from messages.outbound import messages_resend
from messages.redact import redacted
from messages.selectors import (
    SINCE_CHOICES,
    MessageFilter,
    message_is_resendable,
    message_replies,
    messages_filter,
    resendable,
    task_attempts,
)
from reachconsole.core.errors import ConsoleError
from roster.models import Agent

PAGE = 200
BULK_LIMIT = 500


def _filtered(request: HttpRequest):
    flt = MessageFilter.from_query(request.GET)
    return messages_filter(flt), vars(flt)


@require_GET
@login_required
@vary_on_headers("HX-Request")
def message_list(request: HttpRequest) -> HttpResponse:
    qs, f = _filtered(request)
    context = {"rows": qs[:PAGE], "f": f, "statuses": Status.values,
               "directions": Direction.values, "since_choices": SINCE_CHOICES,
               "resendable": resendable(qs).count(), "bulk_limit": BULK_LIMIT,
               "can_resend": request.user.has_perm("a2a.resend_message"),
               "query": request.GET.urlencode()}
    if request.htmx and request.htmx.target == "messages-live":
        return render(request, "messages/_list_live.html", context)
    return render(request, "messages/list.html", context)


@require_GET
@login_required
def message_trace(request: HttpRequest, message_id: str) -> HttpResponse:
    row = get_object_or_404(Message.objects.select_related("resend_of"), message_id=message_id)
    return render(request, "messages/trace.html", {
        "m": row, "payload": redacted(row.payload),
        "transitions": row.transitions.all(), "attempts": task_attempts(row),
        "replies": message_replies(row), "resendable": message_is_resendable(row),
        "can_resend": request.user.has_perm("a2a.resend_message"),
    })


@require_POST
@login_required
@permission_required("a2a.resend_message", raise_exception=True)
def message_resend_view(request: HttpRequest, message_id: str) -> HttpResponse:
    actor = request.user.get_username()
    new_key = request.POST.get("new_key") == "1"
    try:
        rows = messages_resend(message_ids=[message_id], by=actor, new_idempotency_key=new_key)
    except ConsoleError as exc:
        flash.error(request, exc.detail)
        return redirect("a2a:trace", message_id=message_id)
    flash.success(request, "Resent as " + ", ".join(f"{r.message_id} to {r.to_agent_id}: "
                                                    f"{r.status}" for r in rows) + ".")
    return redirect("a2a:trace", message_id=rows[0].message_id)


@require_POST
@login_required
@permission_required("a2a.resend_message", raise_exception=True)
def message_resend_bulk(request: HttpRequest) -> HttpResponse:
    """Resend what the list's filters select (failed task requests only), up to a limit,
    under the same guards as a single resend: all of them, or none when one is refused."""
    request.GET = request.POST  # the filters travel in the form
    qs, f = _filtered(request)
    targets = list(resendable(qs).values_list("message_id", flat=True)[:BULK_LIMIT])
    expected = request.POST.get("expected", "")
    if expected != str(len(targets)):
        flash.error(request, f"The selection changed ({expected} previewed, {len(targets)} "
                    "now): look at the list again and confirm the new count.")
        keep = {k: v for k, v in request.POST.items() if k in ("status", "agent", "direction",
                                                             "since", "q")}
        return redirect(f"{reverse('a2a:list')}?{urlencode(keep)}")
    actor = request.user.get_username()
    try:
        rows = messages_resend(message_ids=targets, by=actor, note=f"filters {f}")
    except ConsoleError as exc:
        flash.error(request, f"{exc.detail}. Narrow the filters to leave it out, or deal "
                    "with it first.")
        return redirect("a2a:list")
    flash.success(request, f"Resent {len(targets)} message{pluralize(len(targets))} as "
                  f"{len(rows)} new transmission{pluralize(len(rows))}.")
    return redirect("a2a:list")


@require_GET
@login_required
def agent_load(request: HttpRequest, agent_id: str) -> HttpResponse:
    """What an agent has in flight, held and refused, and who else covers its capabilities:
    what an operator reads before draining it."""
    agent = get_object_or_404(Agent, agent_id=agent_id)
    sends = Message.objects.filter(direction=Direction.SEND, to_agent_id=agent_id,
                                   message_type="TASK_REQUEST")
    counts = sends.aggregate(
        inflight=Count("id", filter=Q(status__in=[Status.SENT, Status.PUBLISHED], held=False)),
        held=Count("id", filter=Q(status=Status.SENT, held=True)),
        busy=Count("id", filter=Q(status=Status.BUSY,
                                  created_at__gte=timezone.now() - timedelta(hours=1))),
    )
    coverage = []
    for capability in agent.capabilities:
        routed = route_capability(capability=capability, from_agent_id=agent_id,
                                  exclude=[agent_id])
        others = [c for c in routed.candidates if c.agent_id != agent_id]
        coverage.append({"capability": capability, "others": others,
                         "live": [c for c in others if c.routable]})
    return render(request, "messages/_agent_load.html", {
        "agent": agent, "counts": counts, "coverage": coverage,
        "inflight": sends.filter(status__in=[Status.SENT, Status.PUBLISHED])
        .order_by("created_at")[:50],
    })
