"""Message pages: the live timeline an operator filters in an incident (and exports), one
message's whole trace, resend (one or a filtered set), and what an agent still has in flight
before a drain."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from urllib.parse import quote

from asgiref.sync import sync_to_async
from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required, permission_required
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
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
from messages.protocol import MessageType
from messages.redact import redacted
from messages.rows import message_fields
from messages.selectors import (
    PAGE_SIZE,
    SINCE_PRESETS,
    FilterError,
    MessageFilter,
    message_is_resendable,
    messages_new_count,
    messages_page,
    messages_pages,
    newest_message_id,
    resendable_count,
    resendable_selected,
    task_trace,
)
from reachconsole.core.errors import ConsoleError
from roster.loads import LOAD_MEANING, agents_load
from roster.models import Agent

BULK_LIMIT = 500
# An export is bounded: the newest EXPORT_LIMIT rows of the filtered set, read
# EXPORT_CHUNK at a time (one keyset page each) and streamed as they are read.
EXPORT_LIMIT = 100_000
EXPORT_CHUNK = 1000
NEW_COUNT_CAP = 1000
FILTER_PARAMS = ("status", "type", "direction", "agent", "node", "namespace", "conversation",
                 "task", "q", "error", "since", "until")


def _cursor(get) -> int | None:
    raw = (get.get("before") or "").strip()
    if not raw:
        return None
    if not raw.isdigit() or len(raw) > 18:
        raise FilterError(f"before={raw[:40]!r} is not a row id: follow the page's \"Older\" "
                          "link, or leave it out for the newest rows.")
    return int(raw)


def _form(get) -> dict:
    """The filter form as the URL has it, shown back even when it cannot be read."""
    values = {name: (get.get(name) or "")[:265] for name in FILTER_PARAMS if name != "status"}
    values["statuses"] = [s.strip().upper() for v in get.getlist("status") for s in v.split(",")]
    return values


def _list_context(request: HttpRequest) -> dict:
    flt = MessageFilter.from_query(request.GET)
    before = _cursor(request.GET)
    # Read before the rows: a row stored in between is then counted as news by the page
    # (and shown), rather than neither shown nor counted.
    seen_id = newest_message_id()
    page = messages_page(flt, before=before)
    query = urlencode(flt.as_pairs())
    return {"rows": page.rows, "older": page.older, "before": before, "flt": flt,
            "query": query, "seen_id": seen_id, "page_size": PAGE_SIZE,
            "client_filter": flt.for_client(), "export_limit": f"{EXPORT_LIMIT:,}"}


@require_GET
@login_required
@vary_on_headers("HX-Request")
def message_list(request: HttpRequest) -> HttpResponse:
    """The timeline: the newest rows of the filtered set (or those before a cursor); its
    live part is re-rendered by the same partial when events arrive (static/js/timeline.js)."""
    live = bool(request.htmx) and request.htmx.target == "messages-live"
    form = {"f": _form(request.GET), "statuses": Status.values,
            "types": list(MessageType.__members__), "directions": Direction.values,
            "since_presets": SINCE_PRESETS, "bulk_limit": BULK_LIMIT,
            "can_resend": request.user.has_perm("a2a.resend_message")}
    try:
        context = {**form, **_list_context(request)}
    except FilterError as exc:
        if live:
            return render(request, "errors/_error.html", {
                "status": 400, "title": "Filter not understood", "detail": exc.detail},
                status=400)
        return render(request, "messages/list.html", {**form, "filter_error": exc.detail,
                                                      "rows": []}, status=400)
    if live:
        return render(request, "messages/_list_live.html", context)
    return render(request, "messages/list.html", context)


@require_GET
@login_required
@permission_required("a2a.resend_message", raise_exception=True)
def message_resendable(request: HttpRequest) -> HttpResponse:
    """How many failed task requests the filters select, and the form that resends them:
    counted when an operator asks, never on each refresh of the list (over a million rows
    even a capped count costs up to half a second when few rows match)."""
    try:
        flt = MessageFilter.from_query(request.GET)
    except FilterError as exc:
        return render(request, "errors/_error.html", {
            "status": 400, "title": "Filter not understood", "detail": exc.detail},
            status=400)
    up_to = newest_message_id()
    return render(request, "messages/_bulk_resend.html", {
        "flt": flt, "up_to": up_to, "bulk_limit": BULK_LIMIT,
        "resendable": resendable_count(flt, cap=BULK_LIMIT, up_to=up_to)})


@require_GET
@login_required
def message_new_count(request: HttpRequest) -> HttpResponse:
    """How many rows of the filtered set came after `after` (a row id): the exact figure
    for a paused timeline's "N new" bar after a gap in the stream."""
    try:
        flt = MessageFilter.from_query(request.GET)
        after = _cursor({"before": request.GET.get("after", "")}) or 0
    except FilterError as exc:
        return JsonResponse({"error": exc.code, "detail": exc.detail}, status=400)
    up_to = newest_message_id()
    found, whole = messages_new_count(flt, after=after, up_to=up_to, cap=NEW_COUNT_CAP)
    # partial: only the newest rows were looked at, so the count is a floor ("at least").
    return JsonResponse({"after": after, "upTo": up_to, "count": min(found, NEW_COUNT_CAP),
                         "more": found > NEW_COUNT_CAP, "partial": not whole})


EXPORT_FIELDS = ("id", "createdAt", "messageId", "taskId", "messageType", "direction",
                 "status", "error", "attempt", "fromAgentId", "toAgentId", "targetNodeId",
                 "originNodeId", "conversationId", "sceneGroupId", "sessionId", "payload")
# A spreadsheet runs a cell that starts with one of these as a formula; payloads and error
# texts come from the bus.
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _exported(row: Message) -> dict:
    return {"id": row.pk, "createdAt": row.created_at.isoformat(), **message_fields(row),
            "originNodeId": row.origin_node_id or None, "payload": redacted(row.payload)}


def _csv_cell(value) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return "'" + value if value.startswith(FORMULA_START) else value


def _export_chunks(flt: MessageFilter, kind: str) -> Iterator[str]:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    if kind == "csv":
        writer.writerow(EXPORT_FIELDS)
    for rows in messages_pages(flt, limit=EXPORT_LIMIT, chunk=EXPORT_CHUNK):
        for row in rows:
            data = _exported(row)
            if kind == "csv":
                writer.writerow([_csv_cell(data[name]) for name in EXPORT_FIELDS])
            else:
                buffer.write(json.dumps({name: data[name] for name in EXPORT_FIELDS},
                                        ensure_ascii=False) + "\n")
        yield buffer.getvalue()
        buffer.seek(0)
        buffer.truncate()
    if kind == "csv" and buffer.tell():  # the header of an empty export
        yield buffer.getvalue()


_END = object()


async def _streamed(chunks: Iterator[str]) -> AsyncIterator[str]:
    # Under ASGI Django reads a synchronous iterator to its end before sending a byte; read
    # each chunk (one keyset page, one query) in the thread that serves sync code instead.
    read = sync_to_async(next, thread_sensitive=True)
    while (chunk := await read(chunks, _END)) is not _END:
        yield chunk


@require_GET
@login_required
def message_export(request: HttpRequest, kind: str) -> HttpResponse:
    """The timeline's filtered set (same parameters as the page, newest first), at most
    EXPORT_LIMIT rows, payloads redacted (messages/redact.py), as CSV or JSON lines."""
    try:
        flt = MessageFilter.from_query(request.GET)
    except FilterError as exc:
        return render(request, "errors/error.html", {
            "status": 400, "title": "Filter not understood", "detail": exc.detail}, status=400)
    chunks = _export_chunks(flt, kind)
    content = _streamed(chunks) if isinstance(request, ASGIRequest) else chunks
    stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
    response = StreamingHttpResponse(content, content_type={
        "csv": "text/csv; charset=utf-8", "jsonl": "application/x-ndjson; charset=utf-8"}[kind])
    response["Content-Disposition"] = f'attachment; filename="messages-{stamp}.{kind}"'
    response["X-Export-Limit"] = str(EXPORT_LIMIT)
    return response


@require_GET
@login_required
@vary_on_headers("HX-Request")
def message_trace(request: HttpRequest, message_id: str) -> HttpResponse:
    row = get_object_or_404(Message.objects.select_related("resend_of"), message_id=message_id)
    trace = task_trace(row)
    current = next(a for a in trace.attempts if a.row.pk == row.pk)
    context = {
        "m": row, "payload": redacted(row.payload), "trace": trace, "current": current,
        "steps": list(zip(current.transitions, current.states, strict=True)),
        "replies": current.replies,
        "response_payload": redacted(current.response.payload) if current.response else None,
        "candidates": (row.resolution or {}).get("candidates") or [],
        "resendable": message_is_resendable(row),
        "can_resend": request.user.has_perm("a2a.resend_message"),
        "stream": _trace_stream(row),
    }
    if request.htmx and request.htmx.target == "trace-live":
        return render(request, "messages/_trace_live.html", context)
    return render(request, "messages/trace.html", context)


def _trace_stream(row: Message) -> str:
    """The narrowest stream that carries this task's events (PROTOCOL.md "Events"): its
    conversation's, else its scene's, else its session's, else skill_progress. An id the
    WebSocket route cannot carry (a '/') falls back to the whole timeline."""
    for kind, key in (("conversation", row.conversation_id), ("scene", row.scene_group_id),
                      ("session", row.session_id)):
        if key:
            if "/" in key or len(key) > 200:
                return "/ws/timeline/"
            return f"/ws/{kind}/{quote(key, safe='')}/"
    return "/ws/skill_progress/"


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
    try:
        flt = MessageFilter.from_query(request.POST)  # the filters travel in the form
    except FilterError as exc:
        flash.error(request, exc.detail)
        return redirect("a2a:list")
    back = f"{reverse('a2a:list')}?{urlencode(flt.as_pairs())}"
    try:
        up_to = int(request.POST.get("up_to", ""))
    except ValueError:
        flash.error(request, "The resend form is incomplete (no up_to): ask for the count "
                    "again and confirm it.")
        return redirect(back)
    # The same selection as the preview: its time window as fixed moments (the form carries
    # them) and only rows stored by then, so only a change of status can change it.
    targets = list(resendable_selected(flt, up_to=up_to)
                   .values_list("message_id", flat=True)[:BULK_LIMIT])
    expected = request.POST.get("expected", "")
    if expected != str(len(targets)):
        flash.error(request, f"The selection changed ({expected} previewed, {len(targets)} "
                    "now): look at the list again and confirm the new count.")
        return redirect(back)
    actor = request.user.get_username()
    try:
        rows = messages_resend(message_ids=targets, by=actor,
                               note=f"filters {urlencode(flt.as_pairs())}")
    except ConsoleError as exc:
        flash.error(request, f"{exc.detail}. Narrow the filters to leave it out, or deal "
                    "with it first.")
        return redirect(back)
    flash.success(request, f"Resent {len(targets)} message{pluralize(len(targets))} as "
                  f"{len(rows)} new transmission{pluralize(len(rows))}.")
    return redirect(back)


@require_GET
@login_required
def agent_load(request: HttpRequest, agent_id: str) -> HttpResponse:
    """What an agent has in flight, held and refused, and who else covers its capabilities:
    what an operator reads before draining it."""
    agent = get_object_or_404(Agent.objects.select_related("node"), agent_id=agent_id)
    sends = Message.objects.filter(direction=Direction.SEND, to_agent_id=agent_id,
                                   message_type="TASK_REQUEST")
    now = timezone.now()
    # In flight and held are the kept counts (messages/load.py), the same numbers the roster
    # page, backpressure and capability routing use: one definition (roster/loads.py).
    load = agents_load([agent])[agent.agent_id]
    # Each read is bounded by an index range (a2a_agent_held_status: agent, held, status;
    # a2a_status_timeline: status, time), never by the agent's whole history: this part
    # refreshes about once a second while traffic flows.
    open_work = sends.filter(held__in=[False, True])
    counts = {
        "retrying": open_work.filter(status=Status.RETRYING).count(),
        "busy": sends.filter(status=Status.BUSY,
                             created_at__gte=now - timedelta(hours=1)).count(),
    }
    coverage = []
    for capability in agent.capabilities:
        routed = route_capability(capability=capability, from_agent_id=agent_id,
                                  exclude=[agent_id])
        others = [c for c in routed.candidates if c.agent_id != agent_id]
        coverage.append({"capability": capability, "others": others,
                         "live": [c for c in others if c.routable]})
    return render(request, "messages/_agent_load.html", {
        "agent": agent, "counts": counts, "coverage": coverage, "load": load,
        "load_meaning": LOAD_MEANING, "now": now,
        "lease_holds": agent.lease_expires_at > now,
        "can_drain": request.user.has_perm("roster.change_agent"),
        "inflight": open_work.filter(status__in=[Status.SENT, Status.PUBLISHED,
                                                 Status.RETRYING]).order_by("created_at")[:50],
    })
