"""The alarms page (/alarms/): what is wrong now, roots with what they caused, then the
history. Short views; alarms/services.py does the work."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.contrib import messages
from django.contrib.auth.decorators import login_required, permission_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST
from django.views.decorators.vary import vary_on_headers

from alarms.selectors import active_tree, history_page
from alarms.services import NOTE_MAX, AlarmError, alarm_acknowledge
from reachconsole.core.audit import audit_record
from reachconsole.error_pages import WORDS, error_response

PAGE_SIZE = 50
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)
BAD_CURSOR = ("This page's position ('before={value}') is not one the alarms page made. "
              "Start again from the newest alarms.")


def _cursor(alarm) -> str:
    # Whole microseconds, not a float timestamp: the cursor names fired_at exactly.
    return f"{(alarm.fired_at - EPOCH) // MICROSECOND}-{alarm.id}"


def _older_than(value: str) -> tuple[datetime, int] | None:
    if not value:
        return None
    micros, row_id = (int(part) for part in value.split("-", 1))
    return EPOCH + micros * MICROSECOND, row_id


@require_GET
@login_required
@vary_on_headers("HX-Request")
def alarm_list(request: HttpRequest) -> HttpResponse:
    before = request.GET.get("before", "").strip()
    try:
        older_than = _older_than(before)
    except (ValueError, OverflowError):
        return error_response(request, 400, WORDS[400][0], BAD_CURSOR.format(value=before[:40]),
                              WORDS[400][2])
    history, more = history_page(older_than=older_than, size=PAGE_SIZE)
    context = {
        "trees": active_tree(), "history": history, "before": before,
        "older": _cursor(history[-1]) if more else "", "now": timezone.now(),
        "can_ack": request.user.has_perm("alarms.acknowledge_alarm"), "note_max": NOTE_MAX,
    }
    if request.htmx and request.htmx.target == "alarms-live":
        return render(request, "alarms/_alarms_live.html", context)
    return render(request, "alarms/list.html", context)


@require_POST
@login_required
@permission_required("alarms.acknowledge_alarm", raise_exception=True)
def alarm_ack(request: HttpRequest, alarm_id: int) -> HttpResponse:
    actor = request.user.get_username()
    try:
        alarm = alarm_acknowledge(alarm_id=alarm_id, by=actor, note=request.POST.get("note", ""))
    except AlarmError as exc:
        # The service audits what it did, in its transaction; a refusal changed nothing and
        # is audited here.
        audit_record(actor=actor, action="acknowledge-alarm", target=f"alarm {alarm_id}",
                     result="refused", detail=exc.detail)
        messages.error(request, exc.detail)
        return redirect("alarms:list")
    messages.success(request, f"Alarm {alarm.id} ({alarm.kind} {alarm.subject}) is acknowledged "
                     "by you; it stays listed until its condition clears.")
    return redirect("alarms:list")
