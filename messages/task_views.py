"""The task list (/tasks/): one row per task with its outcome, the place ops staff start
from in an incident; its exports; and cancel, of one task or of a filtered set of open ones.
The trace page (/messages/{id}/) stays the task's story."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote, urlsplit

from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required, permission_required
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.template.defaultfilters import pluralize
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.views.decorators.http import require_GET, require_POST
from django.views.decorators.vary import vary_on_headers

from messages.cancel import BULK_CANCEL_MAX, task_cancel, tasks_cancel_bulk
from messages.models import CANCELABLE_STATUSES, Direction, Message, Status, Task
from messages.page_params import export_chunks, filter_form, page_cursor
from messages.protocol import MessageType
from messages.selectors import SINCE_PRESETS, FilterError, MessageFilter
from messages.taskbook import (
    cancelable_tasks,
    task_entries,
    task_is_cancelable,
    task_out,
    tasks_page,
    tasks_pages,
)
from reachconsole.core.errors import ConsoleError
from reachconsole.core.streaming import streamed_for

TASK_PAGE = 100
EXPORT_LIMIT = 100_000
EXPORT_CHUNK = 1000
# What the task list filters on (the timeline's, less the message type).
TASK_STATUSES = [s for s in Status.values if s not in (Status.RETRIED, Status.RECV,
                                                       Status.OBSERVED, Status.LOCAL_CONSUMED)]


def _page_context(request: HttpRequest) -> dict:
    flt = MessageFilter.from_query(request.GET)
    before = page_cursor(request.GET)
    newest = Task.objects.order_by("-id").values_list("id", flat=True).first() or 0
    page = tasks_page(flt, before=before, limit=TASK_PAGE)
    return {"tasks": page.rows, "older": page.older, "before": before, "flt": flt,
            "query": urlencode(flt.as_pairs()), "newest": newest, "page_size": TASK_PAGE,
            "export_limit": f"{EXPORT_LIMIT:,}", "cancelable": CANCELABLE_STATUSES}


@require_GET
@login_required
@vary_on_headers("HX-Request")
def task_list(request: HttpRequest) -> HttpResponse:
    """Tasks newest first with the timeline's filters; the live part is re-rendered by the
    same partial when the stream says something changed (static/js/tasks.js)."""
    live = bool(request.htmx) and request.htmx.target == "tasks-live"
    form = {"f": filter_form(request.GET), "statuses": TASK_STATUSES,
            "directions": Direction.values, "since_presets": SINCE_PRESETS,
            "bulk_limit": BULK_CANCEL_MAX,
            "can_cancel": request.user.has_perm("a2a.cancel_task")}
    try:
        context = {**form, **_page_context(request)}
    except FilterError as exc:
        if live:
            return render(request, "errors/_error.html", {
                "status": 400, "title": "Filter not understood", "detail": exc.detail},
                status=400)
        return render(request, "messages/tasks.html", {**form, "filter_error": exc.detail,
                                                       "tasks": []}, status=400)
    if live:
        return render(request, "messages/_tasks_live.html", context)
    return render(request, "messages/tasks.html", context)


@require_GET
@login_required
def task_detail(request: HttpRequest, task_id: str) -> HttpResponse:
    """A task's story is its trace: the page of its last transmission."""
    entries = task_entries(task_id) if "\x00" not in task_id else []
    if not entries:
        return render(request, "errors/error.html", {
            "status": 404, "title": "No such task",
            "detail": f"No task {task_id[:200]!r} is recorded."}, status=404)
    try:
        return redirect("a2a:trace", message_id=entries[0].last_message_id)
    except NoReverseMatch:  # a message id with a "/", which no page path can carry
        return render(request, "errors/error.html", {
            "status": 404, "title": "No trace page for this task",
            "detail": f"Its last message id {entries[0].last_message_id[:200]!r} cannot be "
                      "part of a page's address; find its messages on the timeline: "
                      f"/messages/?q={quote(task_id[:200])}"}, status=404)


# --- exports --------------------------------------------------------------------------------
EXPORT_FIELDS = ("taskId", "status", "direction", "member", "toAgentId", "fromAgentId",
                 "targetNodeId", "attempts", "firstSentAt", "finishedAt", "durationMs",
                 "answeredBy", "error", "lastMessageId", "conversationId")


def _export_chunks(flt: MessageFilter, kind: str) -> Iterator[str]:
    return export_chunks(tasks_pages(flt, limit=EXPORT_LIMIT, chunk=EXPORT_CHUNK),
                         fields=EXPORT_FIELDS, exported=task_out, kind=kind)


@require_GET
@login_required
def task_export(request: HttpRequest, kind: str) -> HttpResponse:
    """The task list's filtered set, newest first, at most EXPORT_LIMIT tasks."""
    try:
        flt = MessageFilter.from_query(request.GET)
    except FilterError as exc:
        return render(request, "errors/error.html", {
            "status": 400, "title": "Filter not understood", "detail": exc.detail}, status=400)
    chunks = _export_chunks(flt, kind)
    content = streamed_for(request, chunks)
    stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
    response = StreamingHttpResponse(content, content_type={
        "csv": "text/csv; charset=utf-8", "jsonl": "application/x-ndjson; charset=utf-8"}[kind])
    response["Content-Disposition"] = f'attachment; filename="tasks-{stamp}.{kind}"'
    response["X-Export-Limit"] = str(EXPORT_LIMIT)
    return response


# --- cancel ---------------------------------------------------------------------------------
def open_rows(task_id: str) -> list[Message]:
    """What a cancel of this task would end, and where each is (the confirmation's words)."""
    return list(Message.objects.filter(task_id=task_id, direction=Direction.SEND,
                                       message_type=MessageType.TASK_REQUEST,
                                       status__in=sorted(CANCELABLE_STATUSES))
                .only("message_id", "status", "held", "target_node_id", "to_agent_id",
                      "attempt", "published_at").order_by("id")[:50])


@require_GET
@login_required
@permission_required("a2a.cancel_task", raise_exception=True)
def task_cancel_preview(request: HttpRequest, task_id: str) -> HttpResponse:
    """The confirmation: what is open, where, and what a cancel does to each."""
    rows = open_rows(task_id)
    # Back to the page the confirmation was opened on (the task list or the trace).
    current = urlsplit(request.htmx.current_url or "") if request.htmx else None
    back = (f"{current.path}?{current.query}" if current and current.query
            else (current.path if current else "")) or reverse("tasks:list")
    return render(request, "messages/_task_cancel.html", {
        "task_id": task_id, "rows": rows, "back": back,
        "entries": [t for t in task_entries(task_id) if task_is_cancelable(t)]},
        status=200 if rows else 409)


@require_POST
@login_required
@permission_required("a2a.cancel_task", raise_exception=True)
def task_cancel_view(request: HttpRequest, task_id: str) -> HttpResponse:
    by = request.user.get_username()
    back = request.POST.get("next") or ""
    if not back.startswith("/") or back.startswith("//"):
        back = reverse("tasks:list")
    try:
        done = task_cancel(task_id=task_id, by=by, reason=request.POST.get("reason", ""))
    except ConsoleError as exc:
        flash.error(request, exc.detail)
        return redirect(back)
    told = sorted(set(done.told))
    flash.success(request, f"Task {task_id} canceled: {len(done.was)} transmission"
                  f"{pluralize(len(done.was))} ended CANCELED"
                  + (f"; CANCEL sent to {', '.join(told)}." if told
                     else "; none had reached a node."))
    return redirect(back)


@require_GET
@login_required
@permission_required("a2a.cancel_task", raise_exception=True)
def task_cancelable(request: HttpRequest) -> HttpResponse:
    """How many open tasks of ours the filters select, and the form that cancels them:
    counted when an operator asks, not on each refresh."""
    try:
        flt = MessageFilter.from_query(request.GET)
    except FilterError as exc:
        return render(request, "errors/_error.html", {
            "status": 400, "title": "Filter not understood", "detail": exc.detail},
            status=400)
    up_to = Task.objects.order_by("-id").values_list("id", flat=True).first() or 0
    found = cancelable_tasks(flt, up_to=up_to, cap=BULK_CANCEL_MAX)
    return render(request, "messages/_bulk_cancel.html", {
        "flt": flt, "up_to": up_to, "bulk_limit": BULK_CANCEL_MAX, "count": len(found),
        "shown": found[:10]})


@require_POST
@login_required
@permission_required("a2a.cancel_task", raise_exception=True)
def task_cancel_bulk(request: HttpRequest) -> HttpResponse:
    """Cancel what the preview counted: the same filters (the time window pinned), only
    tasks stored by then, at most BULK_CANCEL_MAX."""
    try:
        flt = MessageFilter.from_query(request.POST)
    except FilterError as exc:
        flash.error(request, exc.detail)
        return redirect("tasks:list")
    back = f"{reverse('tasks:list')}?{urlencode(flt.as_pairs())}"
    try:
        up_to = int(request.POST.get("up_to", ""))
    except ValueError:
        flash.error(request, "The cancel form is incomplete (no up_to): ask for the count "
                    "again and confirm it.")
        return redirect(back)
    targets = cancelable_tasks(flt, up_to=up_to, cap=BULK_CANCEL_MAX)[:BULK_CANCEL_MAX]
    done, refused = tasks_cancel_bulk(task_ids=[t.task_id for t in targets],
                                      by=request.user.get_username(),
                                      reason=request.POST.get("reason", ""))
    words = f"Canceled {len(done)} task{pluralize(len(done))}"
    if refused:
        words += (f"; {len(refused)} had ended meanwhile and were left as they were "
                  f"({refused[0][0]}: {refused[0][1]})")
    flash.success(request, words + ".")
    return redirect(back)
