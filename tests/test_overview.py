"""The overview page and the reads behind it: message statistics per time bucket
(messages/stats.py), node and agent counts, capability coverage, and the page itself."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client
from django.utils import timezone

from directory.coverage import capability_coverage
from messages.models import Direction, Message, Status
from messages.stats import message_stats, percentile_cont, stats_forget
from reachconsole.charts import bar_chart, line_chart
from roster import services
from roster.models import ClusterNode
from roster.selectors import node_summary
from tests.conftest import logged_in, register, staff_user

STEP = 15


@pytest.fixture(autouse=True)
def _no_kept_counts_of_earlier_tests():
    """The page keeps settled buckets' counts in the cache, which tests of this run share."""
    moment = int(timezone.now().timestamp())
    for step in (15, 60):
        stats_forget(step_s=step, buckets=range(moment // step - 130, moment // step + 10))


def _aligned_now() -> datetime:
    """The middle of the current 15 s bucket, so rows placed k buckets back land there."""
    epoch = int(timezone.now().timestamp()) // STEP * STEP
    return datetime.fromtimestamp(epoch + 7, tz=UTC)


def row(*, at: datetime, status: str = Status.ACKED, message_type: str = "TASK_REQUEST",
        direction: str = Direction.SEND, **fields) -> Message:
    return Message.objects.create(
        message_id=str(uuid.uuid4()), task_id=fields.pop("task_id", str(uuid.uuid4())),
        message_type=message_type, direction=direction, status=status, created_at=at,
        updated_at=at, to_agent_id=fields.pop("to_agent_id", "fin.tax"), **fields)


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

    previous = stats.buckets[-2]
    assert previous.acked == 10
    assert previous.p(0.5) == pytest.approx(0.055)  # between 50 and 60 ms
    assert previous.p(0.95) == pytest.approx(0.0955)
    assert previous.p(0.99) == pytest.approx(0.0991)
    assert stats.buckets[-1].p(0.5) == pytest.approx(0.4)
    assert stats.buckets[-3].p(0.5) is None  # no value: a gap, not a zero
    assert stats.buckets[-41].p(0.5) == pytest.approx(0.9)
    # The headline is over every value of the last 5 minutes, not an average of buckets'.
    assert stats.latency_since == stats.buckets[-20].start
    assert stats.totals.acked == 11
    assert stats.totals.p(0.5) == pytest.approx(0.06)
    assert stats.totals.p(0.99) == pytest.approx(0.1 + 0.9 * 0.3)


@pytest.mark.django_db
def test_it_buckets_the_hour_per_minute():
    now = _aligned_now()
    acked(at=now - timedelta(minutes=30), latency_ms=20)
    row(at=now - timedelta(minutes=59), status=Status.BUSY)
    row(at=now - timedelta(minutes=61), status=Status.BUSY)

    stats = message_stats(minutes=60, step_s=60, now=now)

    assert len(stats.buckets) == 60
    assert stats.totals.messages == 2 and stats.totals.busy == 1
    assert stats.buckets[-31].acked == 1 and stats.buckets[-31].p(0.95) == pytest.approx(0.02)
    assert stats.totals.acked == 0 and stats.totals.p(0.5) is None  # none in the last 5 min
    with pytest.raises(ValueError):
        message_stats(minutes=15, step_s=7, now=now)


@pytest.mark.django_db
def test_settled_buckets_are_counted_once_and_kept_for_a_minute():
    now = _aligned_now()
    settled = now - timedelta(minutes=5)
    row(at=settled, status=Status.BUSY)
    acked(at=settled, latency_ms=30)
    acked(at=now, latency_ms=50)
    first = message_stats(minutes=15, step_s=STEP, now=now, keep=True)
    assert first.totals.busy == 1 and first.buckets[-21].p(0.5) == pytest.approx(0.03)

    row(at=settled, status=Status.BUSY)  # in a bucket another read has just counted
    row(at=now, status=Status.BUSY)  # the newest minutes are always read from the table
    kept = message_stats(minutes=15, step_s=STEP, now=now, keep=True)

    assert kept.totals.busy == 2
    assert kept.buckets[-21].p(0.5) == pytest.approx(0.03)
    assert kept.totals.acked == 1 and kept.totals.p(0.5) == pytest.approx(0.05)
    assert message_stats(minutes=15, step_s=STEP, now=now).totals.busy == 3


def test_percentile_cont_interpolates_like_postgresql():
    assert percentile_cont([], 0.5) is None
    assert percentile_cont([3.0], 0.99) == 3.0
    assert percentile_cont([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5


@pytest.mark.django_db
def test_it_counts_nodes_by_status_and_class():
    register("fin.tax", "node-a")
    register("fin.vat", "node-b")
    register("llm.chat", "node-c")
    ClusterNode.objects.filter(node_id="node-b").update(status=ClusterNode.Status.DOWN)
    services.node_retire(node_id="node-c", actor="ops")
    ClusterNode.objects.filter(node_id="node-a").update(consistency="OK")

    summary = node_summary()

    assert (summary.total, summary.online, summary.down, summary.retired) == (3, 1, 1, 1)
    assert summary.consistency["OK"] == 1
    assert [n.node_id for n in summary.attention] == ["node-b", "node-c"]


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

    response = viewer.get("/overview/")

    assert response.status_code == 200
    html = response.content.decode()
    assert html.index('data-uncovered="audit"') < html.index('data-tile="rate"')
    assert 'data-uncovered="tax"' not in html
    assert '<b data-agents="online">1</b>' in html and '<b data-agents="draining">1</b>' in html
    assert 'data-stream="/ws/timeline/"' in html
    assert 'hx-trigger="reach:overview-refresh from:body' in html and "js/overview.js" in html
    tile = html[html.index('data-tile="undeliverable"'):]
    assert '<b data-value>1</b>' in tile[:tile.index("</article>")]
    latency = html[html.index('data-tile="latency"'):]
    assert "<b data-value>42 / 42 / 42</b>" in latency[:latency.index("</article>")]
    assert html.count('role="img"') == 8 and "<title id=\"chart-rate-title\">" in html


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
