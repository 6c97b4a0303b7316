"""Message pages: the live timeline an operator filters in an incident (and exports), one
message's whole trace, resend (one or a filtered set), and what an agent still has in flight
before a drain."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import quote

from django.conf import settings
from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required, permission_required
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.template.defaultfilters import pluralize
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.views.decorators.http import require_GET, require_POST
from django.views.decorators.vary import vary_on_headers

from directory.routing import namespace_of, route_capability
from messages.ledger import AGENT, ANSWER_BUCKETS_S, NODE
from messages.models import CANCELABLE_STATUSES, FAILURE_STATUSES, Direction, Message, Status
from messages.outbound import messages_resend
from messages.page_params import export_chunks, filter_form, page_cursor
from messages.protocol import MessageType
from messages.redact import redacted
from messages.rollups import (
    PERCENTILES,
    WINDOWS,
    SubjectStats,
    WindowError,
    bounds_words,
    duration_words,
    quantile_bucket,
    subject_stats,
    subjects_stats,
    window_read,
)
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
from reachconsole.core.metrics import LATENCY_BUCKETS_S
from reachconsole.core.streaming import streamed_for
from roster.loads import LOAD_MEANING, agents_load
from roster.models import Agent, ClusterNode

BULK_LIMIT = 500
# An export is bounded: the newest EXPORT_LIMIT rows of the filtered set, read
# EXPORT_CHUNK at a time (one keyset page each) and streamed as they are read.
EXPORT_LIMIT = 100_000
EXPORT_CHUNK = 1000
NEW_COUNT_CAP = 1000
def _list_context(request: HttpRequest) -> dict:
    flt = MessageFilter.from_query(request.GET)
    before = page_cursor(request.GET)
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
    form = {"f": filter_form(request.GET), "statuses": Status.values,
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
        after = page_cursor({"before": request.GET.get("after", "")}) or 0
    except FilterError as exc:
        return JsonResponse({"error": exc.code, "detail": exc.detail}, status=400)
    up_to = newest_message_id()
    found, whole = messages_new_count(flt, after=after, up_to=up_to, cap=NEW_COUNT_CAP)
    # partial: only the newest rows were looked at, so the count is a floor ("at least").
    return JsonResponse({"after": after, "upTo": up_to, "count": min(found, NEW_COUNT_CAP),
                         "more": found > NEW_COUNT_CAP, "partial": not whole})


EXPORT_FIELDS = ("id", "createdAt", "messageId", "taskId", "messageType", "direction",
                 "status", "error", "attempt", "fromAgentId", "toAgentId", "targetNodeId",
                 "originNodeId", "conversationId", "sceneGroupId", "sessionId", "payload",
                 "payloadDroppedAt")
def _exported(row: Message) -> dict:
    return {"id": row.pk, "createdAt": row.created_at.isoformat(), **message_fields(row),
            "originNodeId": row.origin_node_id or None, "payload": redacted(row.payload),
            # null payload: never stored (observed), or dropped then (REACH_PAYLOAD_KEEP_HOURS)
            "payloadDroppedAt": row.payload_dropped_at.isoformat() if row.payload_dropped_at
            else None}


def _export_chunks(flt: MessageFilter, kind: str) -> Iterator[str]:
    return export_chunks(messages_pages(flt, limit=EXPORT_LIMIT, chunk=EXPORT_CHUNK),
                         fields=EXPORT_FIELDS, exported=_exported, kind=kind)


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
    content = streamed_for(request, chunks)
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
        "payload_keep_hours": settings.REACH_PAYLOAD_KEEP_HOURS,
        "candidates": (row.resolution or {}).get("candidates") or [],
        "resendable": message_is_resendable(row),
        "can_resend": request.user.has_perm("a2a.resend_message"),
        # The task may be canceled while any transmission of ours is still open.
        "cancelable": row.direction == Direction.SEND and any(
            a.row.message_type == MessageType.TASK_REQUEST
            and a.row.status in CANCELABLE_STATUSES for a in trace.attempts),
        "can_cancel": request.user.has_perm("a2a.cancel_task"),
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
    level, words = resent_words(len(targets), rows)
    flash.add_message(request, level, words)
    return redirect(back)


def resent_words(resent: int, rows: list[Message]) -> tuple[int, str]:
    """What a bulk resend did, as the operator must read it: how many new transmissions
    left, and how many ended at once and why (an agent whose lease lapsed, say), rather
    than a success that hides that they all failed again."""
    head = (f"Resent {resent} message{pluralize(resent)} as {len(rows)} new "
            f"transmission{pluralize(len(rows))}")
    ended = [r for r in rows if r.status in FAILURE_STATUSES]
    if not ended:
        return flash.SUCCESS, head + "."
    why: dict[str, int] = {}
    for row in ended:
        why[row.error or row.status] = why.get(row.error or row.status, 0) + 1
    common = sorted(why.items(), key=lambda kv: -kv[1])[:3]
    reasons = "; ".join(f"{n} × {text}" for text, n in common)
    statuses = ", ".join(sorted({r.status for r in ended}))
    gone = len(rows) - len(ended)
    words = (f"{head}: {len(ended)} ended {statuses} at once ({reasons})"
             + (f"; {gone} went out." if gone else "; none went out."))
    return (flash.ERROR if not gone else flash.WARNING), words


def _coverage(capability: str, agent_id: str) -> dict:
    """Who else takes `capability` once `agent_id` drains, as routing will decide it
    (directory/routing.py): for callers in the agent's own namespace (it and the open
    namespaces), and for every other caller (an API send naming no agent, or agents of
    other namespaces, which reach namespaces that are open to them). A preview: it takes
    no round-robin turn."""
    namespace = namespace_of(agent_id)
    near = route_capability(capability=capability, from_agent_id=agent_id,
                            exclude=[agent_id], preview=True)
    anywhere = route_capability(capability=capability, exclude=[agent_id], preview=True)
    others = [c for c in anywhere.candidates if c.agent_id != agent_id]
    live_near = [c for c in near.candidates if c.agent_id != agent_id and c.routable]
    near_ids = {c.agent_id for c in live_near}
    return {"capability": capability, "namespace": namespace, "others": others,
            "live": live_near,
            "elsewhere": [c for c in others if c.routable and c.agent_id not in near_ids]}


@require_GET
@login_required
def agent_load(request: HttpRequest, agent_id: str) -> HttpResponse:
    """What an agent has in flight, held and refused, and who else covers its capabilities:
    what an operator reads before draining it."""
    agent = get_object_or_404(Agent.objects.select_related("node"), agent_id=agent_id)
    sends = Message.objects.filter(direction=Direction.SEND, to_agent_id=agent_id,
                                   message_type=MessageType.TASK_REQUEST)
    now = timezone.now()
    # In flight and held are the kept counts (messages/backpressure.py), the same numbers the roster
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
    coverage = [_coverage(capability, agent_id) for capability in agent.capabilities]
    return render(request, "messages/_agent_load.html", {
        "agent": agent, "counts": counts, "coverage": coverage, "load": load,
        "load_meaning": LOAD_MEANING, "now": now,
        "lease_holds": agent.lease_expires_at > now,
        "can_drain": request.user.has_perm("roster.change_agent"),
        "inflight": open_work.filter(status__in=[Status.SENT, Status.PUBLISHED,
                                                 Status.RETRYING]).order_by("created_at")[:50],
    })


# --- an agent's and a node's numbers (PROTOCOL.md "Tasks, numbers and alarms") -------------
# Read from the kept rollups (messages/rollups.py), never by scanning a window of rows: one
# read per partial, whatever the traffic, so the stream may refresh them about once a second.
# Longer than the column that holds it, an id was never counted: refused before the read.
STATS_AGENT_ID_MAX = Message._meta.get_field("to_agent_id").max_length
STATS_NODE_ID_MAX = Message._meta.get_field("target_node_id").max_length
# The cluster page asks for all its cards in one request; no cluster page has more.
NODES_STATS_MAX = 1000
NODE_CARD_WINDOW = "15m"
TASKS_PATH = "/tasks/"
BAD_STATS_ID = ("{what} {raw!r} cannot have numbers: an id has at most {limit} characters and "
                "no control characters (a NUL, say). Check the address.")
TOO_MANY_NODES = ("Numbers for {n} nodes were asked for at once; at most {limit} can be: "
                  "reload the cluster page.")
# What each count is called and the task-list status that shows its tasks. Counts are of
# transmissions by the status they have now (messages/ledger.py); "tasks" are first attempts.
STAT_COUNTS = (
    ("tasks", "tasks sent", ""),
    ("completed", "completed", Status.COMPLETED),
    ("taskErrors", "task errors", Status.TASK_ERROR),
    ("expired", "expired", Status.EXPIRED),
    ("undeliverable", "undeliverable", Status.UNDELIVERABLE),
    ("nacked", "NACKed", Status.NACKED),
    ("busy", "BUSY", Status.BUSY),
    ("failed", "failed", Status.FAILED),
)


def _between(bucket: tuple[float, float | None] | None) -> str:
    if bucket is None:
        return ""
    low, high = bucket
    if high is None:
        return f"above {duration_words(low)}, the last bound"
    if not low:
        return f"under {duration_words(high)}, the first bound"
    return f"between {duration_words(low)} and {duration_words(high)}"


def _percentiles(stats: SubjectStats, *, bounds: tuple[float, ...], prefix: str,
                 value) -> list[dict]:
    rows = []
    for q in PERCENTILES:
        bucket = quantile_bucket(stats.counts, bounds, prefix, q)
        seconds = value(q) if bucket is not None else None
        rows.append({"name": f"p{round(q * 100)}", "value": duration_words(seconds),
                     "ms": None if seconds is None else round(seconds * 1000, 1),
                     "between": _between(bucket)})
    return rows


def _rate(rate: float | None) -> str:
    return "—" if rate is None else f"{rate * 100:.1f} %"


def _stats_context(stats: SubjectStats, *, kind: str, subject: str, url: str,
                   page_url: str = "") -> dict:
    """The numbers as the partials show them: each count with the task list filtered to it
    (status, the subject, `since` = the window in minutes)."""
    data = stats.as_json()
    minutes = WINDOWS[stats.window][0] // 60
    subject_pair = [(kind, subject), ("since", minutes)]

    def listed(path: str, status: str = "") -> str:
        return f"{path}?{urlencode(([('status', status)] if status else []) + subject_pair)}"

    counts = [{"key": key, "label": label, "n": data[key], "status": status,
               "href": listed(TASKS_PATH, status)} for key, label, status in STAT_COUNTS]
    # A retry is a transmission, not a task outcome: the timeline lists the attempts that
    # were retried (RETRIED), which the task list cannot filter on.
    counts.append({"key": "retries", "label": "retries", "n": data["retries"],
                   "status": Status.RETRIED,
                   "href": listed(reverse("a2a:list"), Status.RETRIED)})
    return {
        "kind": kind, "subject": subject, "stats": stats, "data": data, "counts": counts,
        "window": stats.window, "minutes": minutes, "url": url, "page_url": page_url,
        "windows": [(name, f"{url}?window={name}") for name in WINDOWS],
        "success": _rate(stats.success_rate),
        "ack": _percentiles(stats, bounds=LATENCY_BUCKETS_S, prefix="lat:",
                            value=stats.latency),
        "answer": _percentiles(stats, bounds=ANSWER_BUCKETS_S, prefix="ans:",
                               value=stats.answer),
        "ack_bounds": bounds_words(LATENCY_BUCKETS_S),
        "answer_bounds": bounds_words(ANSWER_BUCKETS_S),
        "tasks_href": listed(TASKS_PATH),
    }


def _stats_refused(request: HttpRequest, title: str, detail: str) -> HttpResponse:
    # The partial's answer is a fragment either way; static/js/console.js shows its words.
    return render(request, "errors/_error.html", {"status": 400, "title": title,
                                                  "detail": detail}, status=400)


def _stats_id_refused(raw: str, *, what: str, limit: int) -> str:
    """Words for an id that cannot have numbers (PostgreSQL cannot even compare a NUL)."""
    if len(raw) > limit or not raw.isprintable():
        return BAD_STATS_ID.format(what=what, raw=raw[:60], limit=limit)
    return ""


def _subject_stats(request: HttpRequest, *, kind: str, subject: str, template: str
                   ) -> HttpResponse:
    scope, limit = ((AGENT, STATS_AGENT_ID_MAX) if kind == "agent"
                    else (NODE, STATS_NODE_ID_MAX))
    refused = _stats_id_refused(subject, what=f"The {kind} id", limit=limit)
    if refused:
        return _stats_refused(request, "Not an id", refused)
    try:
        window = window_read(request.GET.get("window"))
    except WindowError as exc:
        return _stats_refused(request, "Unknown window", exc.detail)
    # The numbers of an id, on the roster or not: an agent that left it still has its past.
    stats = subject_stats(scope=scope, subject=subject, window=window)
    url = reverse(f"a2a:{kind}_stats", args=[subject])
    page_url = reverse("roster:agent", args=[subject]) if kind == "agent" else ""
    return render(request, template, _stats_context(stats, kind=kind, subject=subject,
                                                    url=url, page_url=page_url))


@require_GET
@login_required
@permission_required("a2a.view_message", raise_exception=True)
def agent_stats(request: HttpRequest, agent_id: str) -> HttpResponse:
    """Tasks sent to the agent in a window and what became of them, its success rate and its
    publish → ACK and sent → answered percentiles: the agent page's numbers."""
    return _subject_stats(request, kind="agent", subject=agent_id,
                          template="messages/_agent_stats.html")


@require_GET
@login_required
@permission_required("a2a.view_message", raise_exception=True)
def node_stats(request: HttpRequest, node_id: str) -> HttpResponse:
    """The same numbers for every task sent to agents on the node."""
    return _subject_stats(request, kind="node", subject=node_id,
                          template="messages/_node_stats.html")


def _node_card(node_id: str, *, pk: int, stats: SubjectStats | None, minutes: int) -> dict:
    query = {"node": node_id, "since": minutes}
    counts = stats.counts if stats else {}
    return {
        "pk": pk, "node_id": node_id,
        "tasks": max(0, counts.get("tasks", 0)),
        "expired": stats.n(Status.EXPIRED) if stats else 0,
        "finished": stats.finished if stats else 0,
        "success": _rate(stats.success_rate if stats else None),
        "p95": duration_words(stats.answer(0.95) if stats else None),
        "p95_between": _between(quantile_bucket(counts, ANSWER_BUCKETS_S, "ans:", 0.95)),
        "tasks_href": f"{TASKS_PATH}?{urlencode(query)}",
        "expired_href": f"{TASKS_PATH}?{urlencode({'status': Status.EXPIRED, **query})}",
        "more_url": reverse("a2a:node_stats", args=[node_id]),
    }


@require_GET
@login_required
@permission_required("a2a.view_message", raise_exception=True)
def nodes_stats(request: HttpRequest) -> HttpResponse:
    """The cluster page's cards (`node` once per card): each node's tasks, success rate, p95
    sent → answered and expired over the last 15 minutes, from one read for all of them,
    each swapped into its card out of band (templates/roster/_nodes_live.html)."""
    node_ids = list(dict.fromkeys(n for n in request.GET.getlist("node") if n))
    if len(node_ids) > NODES_STATS_MAX:
        return _stats_refused(request, "Too many nodes", TOO_MANY_NODES.format(
            n=len(node_ids), limit=NODES_STATS_MAX))
    for node_id in node_ids:
        refused = _stats_id_refused(node_id, what="The node id", limit=STATS_NODE_ID_MAX)
        if refused:
            return _stats_refused(request, "Not an id", refused)
    # The cards are named by primary key: a node id may hold "." or ":", and htmx looks a
    # kept (hx-preserve) element up by its id as a CSS selector, unescaped.
    pks = dict(ClusterNode.objects.filter(node_id__in=node_ids).values_list("node_id", "pk"))
    found = subjects_stats(scope=NODE, window=NODE_CARD_WINDOW, subjects=list(pks))
    minutes = WINDOWS[NODE_CARD_WINDOW][0] // 60
    cards = [_node_card(node_id, pk=pks[node_id], stats=found.get(node_id), minutes=minutes)
             for node_id in node_ids if node_id in pks]
    return render(request, "messages/_node_stats.html", {
        "cards": cards, "compact": True, "window": NODE_CARD_WINDOW, "minutes": minutes})
