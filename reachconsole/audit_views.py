"""The audit page (/audit/): who did what to what, when, with what result.

Every signed-in person may read it (a viewer too: roles in reachconsole/core/roles.py). The
rows are written by the services, in the transaction of the change they record
(reachconsole/core/audit.py); this page only reads them. It lives in the composition root
because it links rows to the pages of several apps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta

from django.contrib.auth.decorators import login_required
from django.core.cache import cache
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import NoReverseMatch, reverse
from django.utils.http import urlencode
from django.views.decorators.http import require_GET
from django.views.decorators.vary import vary_on_headers

from reachconsole.core.audit import AuditEntry
from reachconsole.core.moments import utc_moment
from reachconsole.error_pages import WORDS, error_response

PAGE_SIZE = 100
RESULTS = ["ok", "refused", "failed"]
MAX_FIELD = 300  # the longest target; longer input cannot match anything stored

BAD_TIME = ("'{name}' must be a date and time such as 2026-11-30T14:05 (UTC), or empty; "
            "it was '{value}'.")
BAD_RANGE = "'from' ({start}) is after 'to' ({end}): nothing can be in that range."
BAD_CURSOR = ("This page's position ('after={value}') is not one the audit page made. "
              "Start again from the newest rows.")

# Which page shows an action's target: a row links to it.
TARGET_PAGES = {
    "drain": "roster:agent", "undrain": "roster:agent", "deregister": "roster:agent",
    "resend": "a2a:trace",
    "drain-node": "roster:nodes", "retire-node": "roster:nodes",
    "unretire-node": "roster:nodes", "reconcile": "roster:nodes",
}
NO_ARGS = {"roster:nodes"}


class BadAuditQuery(ValueError):
    pass


@dataclass(frozen=True)
class AuditFilter:
    actor: str = ""
    action: str = ""
    target: str = ""          # the target, or the start of it (`fin.` = every agent of fin)
    result: str = ""
    start: datetime | None = None
    end: datetime | None = None

    def as_query(self) -> dict[str, str]:
        values = {k: v for k, v in asdict(self).items() if k not in ("start", "end") and v}
        if self.start:
            values["from"] = _show_time(self.start)
        if self.end:
            values["to"] = _show_time(self.end)
        return values


def _show_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")


def _time(get, name: str) -> datetime | None:
    value = get.get(name, "").strip()
    if not value:
        return None
    try:
        return utc_moment(value)
    except ValueError:
        raise BadAuditQuery(BAD_TIME.format(name=name, value=value[:40])) from None


def audit_filter_from(get) -> AuditFilter:
    result = get.get("result", "").strip()
    flt = AuditFilter(
        actor=get.get("actor", "").strip()[:MAX_FIELD],
        action=get.get("action", "").strip()[:MAX_FIELD],
        target=get.get("target", "").strip()[:MAX_FIELD],
        result=result if result in RESULTS else "",
        start=_time(get, "from"), end=_time(get, "to"),
    )
    if flt.start and flt.end and flt.start > flt.end:
        raise BadAuditQuery(BAD_RANGE.format(start=_show_time(flt.start),
                                             end=_show_time(flt.end)))
    return flt


def audit_entries(flt: AuditFilter) -> QuerySet[AuditEntry]:
    qs = AuditEntry.objects.all()
    if flt.actor:
        qs = qs.filter(actor=flt.actor)
    if flt.action:
        qs = qs.filter(action=flt.action)
    if flt.target:
        qs = qs.filter(target__startswith=flt.target)
    if flt.result:
        qs = qs.filter(result=flt.result)
    if flt.start:
        qs = qs.filter(at__gte=flt.start)
    if flt.end:
        qs = qs.filter(at__lte=flt.end)
    return qs.order_by("-at", "-id")


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)


def _cursor(row: AuditEntry) -> str:
    # Whole microseconds, not a float timestamp: the cursor must name `at` exactly.
    return f"{(row.at - EPOCH) // MICROSECOND}-{row.id}"


def _after(value: str) -> Q | None:
    """Rows older than the cursor's (at, id): keyset paging over the `at` index, so a late
    page costs what the first does (never OFFSET, never a COUNT)."""
    if not value:
        return None
    try:
        micros, row_id = (int(part) for part in value.split("-", 1))
        at = EPOCH + micros * MICROSECOND
    except (ValueError, OverflowError, OSError):
        raise BadAuditQuery(BAD_CURSOR.format(value=value[:40])) from None
    return Q(at__lt=at) | Q(at=at, id__lt=row_id)


def _known_actions() -> list[str]:
    # For the action field's suggestions only; a minute old is fresh enough.
    return cache.get_or_set(
        "audit-actions",
        lambda: sorted(AuditEntry.objects.values_list("action", flat=True).distinct()[:200]),
        60,
    )


def _target_url(row: AuditEntry) -> str:
    name = TARGET_PAGES.get(row.action)
    if not name:
        return ""
    try:
        return reverse(name) if name in NO_ARGS else reverse(name, args=[row.target])
    except NoReverseMatch:
        return ""


@require_GET
@login_required
@vary_on_headers("HX-Request")
def audit_list(request: HttpRequest) -> HttpResponse:
    try:
        flt = audit_filter_from(request.GET)
        after = request.GET.get("after", "").strip()
        older = _after(after)
    except BadAuditQuery as exc:
        return error_response(request, 400, WORDS[400][0], str(exc), WORDS[400][2])
    qs = audit_entries(flt)
    if older is not None:
        qs = qs.filter(older)
    rows = list(qs[:PAGE_SIZE + 1])
    more = len(rows) > PAGE_SIZE
    rows = rows[:PAGE_SIZE]
    for row in rows:
        row.target_url = _target_url(row)
    query = flt.as_query()
    context = {
        "rows": rows, "flt": flt, "query": query, "after": after, "results": RESULTS,
        "actions": _known_actions(), "page_size": PAGE_SIZE,
        "from_value": query.get("from", ""), "to_value": query.get("to", ""),
        "first_query": urlencode(query),
        "next_query": urlencode({**query, "after": _cursor(rows[-1])}) if more else "",
    }
    if request.htmx and request.htmx.target == "audit-live":
        return render(request, "audit/_rows.html", context)
    return render(request, "audit/list.html", context)
