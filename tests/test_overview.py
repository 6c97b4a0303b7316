"""The overview page and the reads behind it: message statistics per time bucket
(messages/stats.py), node and agent counts, capability coverage, and the page itself."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client
from django.utils import timezone

from alarms.evaluate import alarms_evaluate
from directory.coverage import capability_coverage
from messages.models import Change, Direction, Message, Status
from messages.rollups import rollups_fold
from messages.state import changes_apply, messages_insert_new
from messages.stats import message_stats
from reachconsole.charts import bar_chart, line_chart
from roster import services
from roster.models import ClusterNode
from roster.selectors import node_summary
from tests.conftest import logged_in, register, staff_user

STEP = 15


def _aligned_now() -> datetime:
    """The middle of the current 15 s bucket, so rows placed k buckets back land there."""
    epoch = int(timezone.now().timestamp()) // STEP * STEP
    return datetime.fromtimestamp(epoch + 7, tz=UTC)


def row(*, at: datetime, status: str = Status.ACKED, message_type: str = "TASK_REQUEST",
        direction: str = Direction.SEND, **fields) -> Message:
    """A row as the writers store it: counted by the ledger as it is inserted."""
    message = Message(
        message_id=str(uuid.uuid4()), task_id=fields.pop("task_id", str(uuid.uuid4())),
        message_type=message_type, direction=direction, status=status, created_at=at,
        updated_at=at, to_agent_id=fields.pop("to_agent_id", "fin.tax"), **fields)
    (stored,) = messages_insert_new([message])
    return stored


def acked(*, at: datetime, latency_ms: float) -> Message:
    return row(at=at, published_at=at, acked_at=at + timedelta(milliseconds=latency_ms))


@pytest.mark.django_db
def test_it_counts_each_kind_of_row_in_the_bucket_it_was_created_in():
    now = _aligned_now()
    back = now - timedelta(seconds=2 * STEP)  # two buckets before the newest
    for _ in range(3):
        row(at=back, status=Status.COMPLETED)
    row(at=back, status=Status.BUSY)
    row(at=back, status=Status.UNDELIVERABLE)
    row(at=back, status=Status.UNDELIVERABLE)
    row(at=back, status=Status.FAILED)
    row(at=back, status=Status.SENT, held=True)
    row(at=back, status=Status.PUBLISHED, attempt=2)  # a retry
    row(at=back, status=Status.PUBLISHED, message_type="ACK", payload={"duplicate": True})
    row(at=back, status=Status.PUBLISHED, message_type="ACK", payload={"duplicate": False})
    row(at=back, status=Status.RECV, direction=Direction.RECV, attempt=3)  # not our retry
    row(at=now, status=Status.FAILED)
    row(at=now - timedelta(minutes=16), status=Status.FAILED)  # before the window

    stats = message_stats(minutes=15, step_s=STEP, now=now)

    assert len(stats.buckets) == 60
    assert stats.buckets[-1].start <= now < stats.buckets[-1].start + timedelta(seconds=STEP)
    two_back = stats.buckets[-3]
    assert (two_back.messages, two_back.busy, two_back.undeliverable, two_back.failed,
            two_back.held, two_back.retries, two_back.duplicates) == (12, 1, 2, 1, 1, 1, 1)
    assert two_back.rate == 12 / STEP
    assert (stats.buckets[-1].messages, stats.buckets[-1].failed) == (1, 1)
    assert sum(b.messages for b in stats.buckets[:-3]) == 0
    totals = stats.totals
    assert (totals.messages, totals.failed, totals.undeliverable, totals.busy) == (13, 2, 2, 1)
    assert stats.series("failed")[-3:] == [1, 0, 1]


@pytest.mark.django_db
def test_it_computes_latency_percentiles_from_publish_to_ack():
    now = _aligned_now()
    back = now - timedelta(seconds=STEP)
    for ms in range(10, 101, 10):  # 10, 20, … 100 ms
        acked(at=back, latency_ms=ms)
    acked(at=now, latency_ms=400)
    acked(at=now - timedelta(minutes=10), latency_ms=900)  # in its bucket, not the headline
    # Not ours, not acknowledged, or not taken by the broker: no publish → ACK time.
    row(at=back, direction=Direction.OBSERVED, status=Status.ACKED, published_at=back,
        acked_at=back + timedelta(seconds=9))
    row(at=back, status=Status.PUBLISHED, published_at=back)
    row(at=back, status=Status.ACKED, acked_at=back + timedelta(seconds=9))

    stats = message_stats(minutes=15, step_s=STEP, now=now)

    # From the histogram (reachconsole.core.metrics.LATENCY_BUCKETS_S), placed linearly
    # inside the bucket that holds the rank, as Prometheus's histogram_quantile does.
    previous = stats.buckets[-2]
    assert previous.acked == 10
    assert previous.p(0.5) == pytest.approx(0.05)  # 3 of 10 in 25–50 ms, 2 below
    assert previous.p(0.95) == pytest.approx(0.095)  # 5 of 10 in 50–100 ms
    assert previous.p(0.99) == pytest.approx(0.099)
    assert stats.buckets[-1].p(0.5) == pytest.approx(0.375)  # 400 ms: in 250–500 ms
    assert stats.buckets[-3].p(0.5) is None  # no value: a gap, not a zero
    assert stats.buckets[-41].p(0.5) == pytest.approx(0.75)  # 900 ms: in 0.5–1 s
    # The headline is over every value of the last 5 minutes, not an average of buckets'.
    assert stats.latency_since == stats.buckets[-20].start
    assert stats.totals.acked == 11
    assert stats.totals.p(0.5) == pytest.approx(0.055)
    assert stats.totals.p(0.99) == pytest.approx(0.25 + 0.25 * 0.89)


@pytest.mark.django_db
def test_it_buckets_the_hour_per_minute():
    now = _aligned_now()
    acked(at=now - timedelta(minutes=30), latency_ms=20)
    row(at=now - timedelta(minutes=59), status=Status.BUSY)
    row(at=now - timedelta(minutes=61), status=Status.BUSY)

    stats = message_stats(minutes=60, step_s=60, now=now)

    assert len(stats.buckets) == 60
    assert stats.totals.messages == 2 and stats.totals.busy == 1
    assert stats.buckets[-31].acked == 1
    assert stats.buckets[-31].p(0.95) == pytest.approx(0.01 + 0.015 * 0.95)  # in 10–25 ms
    assert stats.totals.acked == 0 and stats.totals.p(0.5) is None  # none in the last 5 min
    with pytest.raises(ValueError):
        message_stats(minutes=15, step_s=7, now=now)


@pytest.mark.django_db
def test_a_row_that_moves_is_counted_in_its_new_status_in_the_bucket_it_was_sent_in():
    now = _aligned_now()
    sent = now - timedelta(minutes=5)
    waiting = row(at=sent, status=Status.ACKED, published_at=sent,
                  acked_at=sent + timedelta(milliseconds=30))
    row(at=sent, status=Status.BUSY)
    first = message_stats(minutes=15, step_s=STEP, now=now)
    assert (first.totals.busy, first.totals.expired, first.totals.task_errors) == (1, 0, 0)

    changes_apply([Change(pk=waiting.pk, to=Status.EXPIRED, actor="sweeper", reason="late",
                          fields={"error": "acknowledged, no response", "finished_at": now})],
                  now=now)
    later = message_stats(minutes=15, step_s=STEP, now=now)

    assert (later.totals.busy, later.totals.expired) == (1, 1)
    assert later.buckets[-21].expired == 1 and later.buckets[-1].expired == 0
    assert later.buckets[-21].acked == 1  # its publish → ACK time stays counted
    # Beat folds the rows of each key into one, at every width: the numbers stay as they
    # were, at the finest width and at the wider ones the fold made.
    wider = message_stats(minutes=60, step_s=60, now=now).totals
    folded = rollups_fold(now=now)
    assert folded.read > 0 and folded.written > 0
    assert message_stats(minutes=15, step_s=STEP, now=now).totals == later.totals
    assert message_stats(minutes=60, step_s=60, now=now).totals == wider
    assert wider.expired == 1


@pytest.mark.django_db
def test_it_counts_nodes_by_status_and_class():
    register("fin.tax", "node-a")
    register("fin.vat", "node-b")
    register("llm.chat", "node-c")
    register("fin.new", "node-d")  # never heard
    services.node_seen(node_id="node-a")
    ClusterNode.objects.filter(node_id="node-b").update(status=ClusterNode.Status.DOWN)
    services.node_retire(node_id="node-c", actor="ops")
    ClusterNode.objects.filter(node_id="node-a").update(consistency="OK")

    summary = node_summary()

    assert (summary.total, summary.online, summary.down, summary.registered,
            summary.retired) == (4, 1, 1, 1, 1)
    assert summary.consistency["OK"] == 1
    assert [n.node_id for n in summary.attention] == ["node-b", "node-c", "node-d"]


@pytest.mark.django_db
@pytest.mark.usefixtures("console_hears")
def test_a_silent_node_is_never_down_beside_a_green_ok(viewer, now):
    """DOWN showed beside OK on the node's card and on the overview until the next
    reconciliation: the sweep that finds the silence says STALE at once, with its words."""
    register("fin.tax", "node-a")
    services.node_seen(node_id="node-a", heartbeat_ms=1000, now=now)
    assert ClusterNode.objects.get(node_id="node-a").consistency == "OK"
    assert services.nodes_sweep(now=now + timedelta(seconds=4)) == 1
    node = ClusterNode.objects.get(node_id="node-a")
    assert (node.status, node.consistency) == ("DOWN", "STALE")
    assert node.consistency_reason == ("node node-a has been silent for 4 s (more than 3 s, "
                                       "three heartbeats)")
    for page, start, end in (("/overview/", 'data-node="node-a"', "</li>"),
                             ("/cluster/", 'id="node-node-a"', "</h2>")):
        html = viewer.get(page).content.decode()
        card = html[html.index(start):]
        card = card[:card.index(end)]
        assert "badge DOWN" in card and "badge STALE" in card, page
        assert "badge OK" not in card, page


@pytest.mark.django_db
def test_a_capability_without_a_routable_agent_is_uncovered():
    register("fin.tax", "node-a", capabilities=["tax", "vat"])
    register("fin.vat", "node-b", capabilities=["vat"])
    register("llm.audit", "node-b", capabilities=["audit"])
    services.agent_drain(agent_id="llm.audit", actor="ops")

    coverage = capability_coverage()

    assert [(c.capability, c.routable, c.total) for c in coverage] == [
        ("audit", 0, 1), ("tax", 1, 1), ("vat", 2, 2)]
    assert coverage[0].uncovered
    assert coverage[0].unroutable == [("llm.audit", "draining: it takes no new work")]


@pytest.fixture
def viewer():
    return logged_in(staff_user("vera", "view_agent", "view_message"))


@pytest.mark.django_db
def test_the_page_shows_the_numbers_and_the_alarm_first(viewer):
    register("fin.tax", "node-a", capabilities=["tax"])
    register("llm.audit", "node-b", capabilities=["audit"])
    services.agent_drain(agent_id="llm.audit", actor="ops")
    now = timezone.now()
    row(at=now - timedelta(seconds=20), status=Status.UNDELIVERABLE)
    acked(at=now - timedelta(seconds=20), latency_ms=42)
    alarms_evaluate()  # what beat does every few seconds: the strip shows the alarm records

    response = viewer.get("/overview/")

    assert response.status_code == 200
    html = response.content.decode()
    assert html.index('data-uncovered="audit"') < html.index('data-tile="rate"')
    assert 'data-uncovered="tax"' not in html
    assert "No agent can take capability:audit" in html
    assert '<b data-agents="online">1</b>' in html and '<b data-agents="draining">1</b>' in html
    assert 'data-stream="/ws/timeline/"' in html
    assert 'hx-trigger="reach:overview-refresh from:body' in html and "js/overview.js" in html
    tile = html[html.index('data-tile="undeliverable"'):]
    assert '<b data-value>1</b>' in tile[:tile.index("</article>")]
    latency = html[html.index('data-tile="latency"'):]
    # 42 ms lies in the 25–50 ms bucket: the percentiles are placed inside it.
    assert "<b data-value>38 / 49 / 50</b>" in latency[:latency.index("</article>")]
    answer = html[html.index('data-tile="answer"'):]
    assert "<b data-value>– / – / –</b>" in answer[:answer.index("</article>")]  # none yet
    assert html.count('role="img"') == 11
    assert "publish → ACK: 5 ms, 10 ms, 25 ms, 50 ms, 100 ms, 250 ms, 500 ms, 1 s" in html
    assert "<title id=\"chart-rate-title\">" in html


@pytest.mark.django_db
def test_a_live_refresh_gets_the_partial_only(viewer):
    response = viewer.get("/overview/?window=1h", headers={"HX-Request": "true",
                                                           "HX-Target": "overview-live"})
    assert response.status_code == 200
    html = response.content.decode()
    assert "<html" not in html and 'data-tile="rate"' in html
    assert "the last hour, per minute" in html


@pytest.mark.django_db
def test_an_unknown_window_is_refused_with_words(viewer):
    response = viewer.get("/overview/?window=week")
    assert response.status_code == 400
    assert "There is no window &#x27;week&#x27; on the overview" in response.content.decode()


@pytest.mark.django_db
def test_it_needs_a_signed_in_person():
    response = Client().get("/overview/")
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]


def test_charts_scale_to_the_peak_and_break_lines_at_gaps():
    chart = bar_chart([0, 2, 4], title="t", summary="s", width=30, height=10)
    assert chart.top == 4 and len(chart.bars) == 2
    assert chart.bars[1].height == pytest.approx(9.0) and chart.bars[0].height == 4.5
    lines = line_chart({"p50": [1.0, None, 2.0, 2.0]}, title="t", summary="s", width=40,
                       height=10)
    assert len(lines.lines[0].runs) == 2  # a lone point, then a pair
    assert bar_chart([0, 0], title="t", summary="s").empty


@pytest.mark.django_db
def test_numbers_are_counted_again_from_rows_written_around_the_services():
    now = _aligned_now()
    row(at=now - timedelta(minutes=3), status=Status.BUSY)  # counted as it was written
    for _ in range(2):  # written around the ledger, as a console that kept no numbers did
        at = now - timedelta(minutes=1)
        Message.objects.create(message_id=str(uuid.uuid4()), task_id="t", created_at=at,
                               updated_at=at, message_type="TASK_REQUEST",
                               direction=Direction.SEND, status=Status.EXPIRED,
                               to_agent_id="fin.tax")
    assert message_stats(minutes=15, step_s=STEP, now=now).totals.expired == 0

    from django.core.management import call_command

    call_command("rollups_rebuild", "--hours", "1")

    stats = message_stats(minutes=15, step_s=STEP, now=now)
    assert (stats.totals.expired, stats.totals.busy, stats.totals.messages) == (2, 1, 3)
