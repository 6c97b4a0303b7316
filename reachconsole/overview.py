"""The overview page (/overview/): the network at a glance, for the first look in an incident.

It composes what each app owns (ARCHITECTURE.md): the roster's nodes and agents, the
directory's capability coverage, the messages' statistics over time, and what readiness
knows of the broker. The live part is one partial (templates/overview/_overview_live.html),
rendered for the first page and again whenever the stream says a message changed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET
from django.views.decorators.vary import vary_on_headers

from alarms.selectors import active_tree
from directory.coverage import capability_coverage
from messages.broker_caps import EMBEDDED_WORDS, broker_caps_read
from messages.rollups import bounds_words
from messages.selectors import load_totals
from messages.stats import MessageStats, message_stats
from reachconsole import health
from reachconsole.charts import Chart, bar_chart, line_chart
from reachconsole.core.broker_drops import broker_drops_read
from reachconsole.core.metrics import counters_snapshot
from reachconsole.error_pages import error_response
from roster.hearing import bridges_hearing
from roster.selectors import node_summary, roster_counts

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Window:
    key: str
    minutes: int
    step_s: int
    label: str  # "the last 15 minutes, per 15 s"


WINDOWS = {
    "15m": Window("15m", 15, 15, "the last 15 minutes, per 15 s"),
    "1h": Window("1h", 60, 60, "the last hour, per minute"),
}
DEFAULT_WINDOW = "15m"
BAD_WINDOW = "There is no window {value!r} on the overview: choose one of {choices}."


@dataclass(frozen=True)
class Tile:
    """One number of the message statistics, with its chart."""

    key: str  # data-tile, and the anchor of its chart
    label: str
    value: str
    unit: str
    note: str
    chart: Chart
    level: str = ""  # "", "warn" or "bad": how loud the tile is
    status: str = ""  # a timeline status filter that lists these rows


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    ms = seconds * 1000
    return f"{ms:.0f}" if ms >= 10 else f"{ms:.1f}"


def _count_tile(stats: MessageStats, window: Window, *, key: str, label: str, note: str,
                level: str, status: str = "") -> Tile:
    values = stats.series(key)
    total = getattr(stats.totals, key)
    summary = (f"{label} over {window.label}: {total} in all, at most {max(values, default=0)} "
               "in one bucket")
    return Tile(key=key, label=label, value=str(total), unit="", note=note,
                chart=bar_chart(values, title=f"{label}, {window.label}", summary=summary),
                level=level if total else "", status=status)


def message_tiles(stats: MessageStats, window: Window, *, held_total: int,
                  inflight_total: int) -> list[Tile]:
    buckets = stats.buckets
    # The newest bucket is still filling: "now" is the last whole one.
    now_rate = buckets[-2].rate if len(buckets) > 1 else stats.totals.rate
    rates = stats.series("rate")
    rate_tile = Tile(
        key="rate", label="Messages/s", value=f"{now_rate:.1f}", unit="/s",
        note=f"{stats.totals.messages} in {window.label.split(',')[0]} "
             f"(average {stats.totals.rate:.1f}/s)",
        chart=bar_chart(rates, title=f"Messages per second, {window.label}",
                        summary=f"now {now_rate:.1f}/s, peak {max(rates, default=0):.1f}/s, "
                                f"{stats.totals.messages} messages in all"))
    p = stats.totals.latency
    latency_tile = Tile(
        key="latency", label="Delivery latency p50 / p95 / p99",
        value=" / ".join(_ms(p.get(q)) for q in (0.5, 0.95, 0.99)), unit="ms",
        note=f"publish → ACK of {stats.totals.acked} task request"
             f"{'' if stats.totals.acked == 1 else 's'} in the last "
             f"{round((stats.until - stats.latency_since).total_seconds() / 60)} minutes",
        chart=line_chart({"p50": stats.series("p50"), "p95": stats.series("p95"),
                          "p99": stats.series("p99")},
                         title=f"Delivery latency p50, p95 and p99, {window.label}",
                         summary=f"p50 {_ms(p.get(0.5))} ms, p95 {_ms(p.get(0.95))} ms, "
                                 f"p99 {_ms(p.get(0.99))} ms over the last minutes"))
    a = stats.totals.answer
    answer_tile = Tile(
        key="answer", label="Answer time p50 / p95 / p99",
        value=" / ".join(_ms(a.get(q)) for q in (0.5, 0.95, 0.99)), unit="ms",
        note=f"sent (or first seen) → response, of {stats.totals.answered} task request"
             f"{'' if stats.totals.answered == 1 else 's'} in the last "
             f"{round((stats.until - stats.latency_since).total_seconds() / 60)} minutes, "
             "the console's and those seen between other nodes",
        chart=line_chart({"p50": stats.series("a50"), "p95": stats.series("a95"),
                          "p99": stats.series("a99")},
                         title=f"Answer time p50, p95 and p99, {window.label}",
                         summary=f"p50 {_ms(a.get(0.5))} ms, p95 {_ms(a.get(0.95))} ms, "
                                 f"p99 {_ms(a.get(0.99))} ms over the last minutes"))
    return [
        rate_tile, latency_tile, answer_tile,
        _count_tile(stats, window, key="retries", label="Retries", level="warn",
                    note="new attempts of a task: no ACK in time, a retryable NACK, or BUSY"),
        _count_tile(stats, window, key="duplicates", label="Duplicates", level="warn",
                    note="repeats absorbed by idempotency (ACKed as duplicate, not run again)"),
        _count_tile(stats, window, key="held", label="Held", level="warn",
                    note=f"sent in this window and still held behind maxInflight "
                         f"({held_total} held and {inflight_total} in flight in all)"),
        _count_tile(stats, window, key="busy", label="BUSY", level="bad", status="BUSY",
                    note="refused: the agent's queue was full"),
        _count_tile(stats, window, key="undeliverable", label="UNDELIVERABLE", level="bad",
                    status="UNDELIVERABLE", note="no node could be resolved; not published"),
        _count_tile(stats, window, key="failed", label="FAILED", level="bad", status="FAILED",
                    note="the broker did not take it in time"),
        _count_tile(stats, window, key="expired", label="EXPIRED", level="bad",
                    status="EXPIRED", note="no answer within the task's timeoutMs (sent by the "
                    "console or seen on the bus)"),
        _count_tile(stats, window, key="task_errors", label="TASK_ERROR", level="bad",
                    status="TASK_ERROR", note="answered: the agent reported that the task "
                    "failed"),
    ]


def broker_state(*, now: datetime) -> dict:
    """What readiness and the bridge know of the broker, each part on its own: one source
    that cannot be read (Redis down) leaves the others shown."""
    ok, detail = health.broker_check()
    state: dict = {"ok": ok, "detail": detail, "bridges": [], "drops": None,
                   "reconnects": None, "caps": [], "limits": [], "embedded": ""}
    try:
        state["bridges"] = bridges_hearing(now=now)
    except Exception as exc:  # the broker check above already says what failed
        log.warning("overview: could not list the bridges (%s)", exc)
    state["delivery"], _ = health.delivery_check()
    try:
        # What each bridge found the broker cannot do (messages/broker_caps.py).
        state["caps"] = broker_caps_read(now=now)
        live = [entry for entry in state["caps"] if entry.get("connected")]
        if live and all(entry.get("embedded") for entry in live):
            # make run's own broker: what it lacks is expected there, said once, calmly.
            state["embedded"] = EMBEDDED_WORDS
        else:
            state["limits"] = sorted({words for entry in live for words in entry["limits"]})
        state["drops"] = broker_drops_read()
        counters = counters_snapshot()
        state["reconnects"] = sum(v for k, v in counters.items() if k.startswith("reconnects:"))
        state["duplicates_total"] = sum(counters.get(k, 0) for k in (
            "duplicate_message_id", "duplicate_idempotency_key"))
    except Exception as exc:  # the cache is down: the delivery check says so
        log.warning("overview: could not read the shared counters (%s)", exc)
    return state


# Coverage reads every agent: shared between open pages for this long (an alarm may show
# this much late).
COVERAGE_REUSE_S = 5


@require_GET
@login_required
@vary_on_headers("HX-Request")
def overview(request: HttpRequest) -> HttpResponse:
    key = request.GET.get("window", DEFAULT_WINDOW)
    window = WINDOWS.get(key)
    if window is None:
        return error_response(request, 400, "Unknown window", BAD_WINDOW.format(
            value=key[:20], choices=", ".join(WINDOWS)), "bad_request")
    now = timezone.now()
    stats = message_stats(minutes=window.minutes, step_s=window.step_s, now=now)
    inflight, held = load_totals()
    coverage = capability_coverage(now=now, reuse_s=COVERAGE_REUSE_S)
    context = {
        "now": now, "window": window, "windows": WINDOWS.values(),
        "nodes": node_summary(), "agents": roster_counts(now=now),
        "coverage": coverage,
        # The strip at the top: the alarm records (alarms/evaluate.py), roots then children.
        "alarm_trees": active_tree(),
        "broker": broker_state(now=now), "stats": stats,
        "tiles": message_tiles(stats, window, held_total=held, inflight_total=inflight),
        "latency_bounds": bounds_words(stats.latency_bounds_s),
        "answer_bounds": bounds_words(stats.answer_bounds_s),
    }
    if request.htmx and request.htmx.target == "overview-live":
        return render(request, "overview/_overview_live.html", context)
    return render(request, "overview/overview.html", context)
