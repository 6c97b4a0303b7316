"""Message statistics over time for the overview page: how much moved, how fast it was
acknowledged, and what went wrong, per time bucket of the last minutes or hour.

Read from the numbers kept as rows are written (messages/ledger.py, messages/rollups.py):
one grouped read of the window's buckets, whatever the traffic in them. A row is counted in
the bucket it was created in, with the status it has now (a request sent at 10:01 and found
UNDELIVERABLE is an UNDELIVERABLE of 10:01).

Latency is publish → ACK of our task requests, as in the `reach_delivery_latency_seconds`
histogram, and sent → answered of every task request: per bucket, and as a headline over
the last HEADLINE_S whatever the window (what it is now). Both come from histograms, so the
percentiles are approximate within the bucket bounds the page names.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from django.utils import timezone

from messages.ledger import ALL, ANSWER_BUCKETS_S, status_metric
from messages.models import Status
from messages.rollups import bucket_at, quantiles, rollup_buckets
from reachconsole.core.metrics import LATENCY_BUCKETS_S

PERCENTILES = (0.5, 0.95, 0.99)
# The headline latency is over the last 5 minutes, whatever the window: what it is now.
HEADLINE_S = 300
STEPS = (15, 60)  # the widths the console's own numbers are kept at for this page

# The counts kept per bucket, in the order the page shows them, and where each comes from.
SOURCES = {
    "messages": "messages", "retries": "retries", "duplicates": "duplicates", "held": "held",
    "busy": status_metric(Status.BUSY), "undeliverable": status_metric(Status.UNDELIVERABLE),
    "failed": status_metric(Status.FAILED), "expired": status_metric(Status.EXPIRED),
    "task_errors": status_metric(Status.TASK_ERROR),
    "completed": status_metric(Status.COMPLETED),
    "canceled": status_metric(Status.CANCELED),
}
COUNTS = tuple(SOURCES)


@dataclass
class Bucket:
    start: datetime
    seconds: float  # how much of it has passed (the newest bucket is still filling)
    messages: int = 0
    retries: int = 0
    duplicates: int = 0
    held: int = 0
    busy: int = 0
    undeliverable: int = 0
    failed: int = 0
    expired: int = 0
    task_errors: int = 0
    completed: int = 0
    canceled: int = 0
    acked: int = 0  # task requests with a publish → ACK time
    latency: dict[float, float | None] = field(default_factory=dict)  # percentile → seconds
    answered: int = 0  # task requests with a sent → answered time
    answer: dict[float, float | None] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """Messages a second over the part of the bucket that has passed."""
        return self.messages / max(self.seconds, 1.0)

    def p(self, q: float) -> float | None:
        return self.latency.get(q)


@dataclass(frozen=True)
class MessageStats:
    since: datetime
    until: datetime
    step_s: int
    buckets: list[Bucket]
    totals: Bucket  # the whole window's counts; latency since `latency_since`
    latency_since: datetime  # the headline percentiles are over the values since then
    latency_bounds_s: tuple[float, ...] = LATENCY_BUCKETS_S
    answer_bounds_s: tuple[float, ...] = ANSWER_BUCKETS_S

    @property
    def window_s(self) -> float:
        return (self.until - self.since).total_seconds()

    def series(self, name: str) -> list[float | None]:
        """One value per bucket, oldest first: a count, `rate`, `p50`/`p95`/`p99` (publish →
        ACK) or `a50`/`a95`/`a99` (sent → answered)."""
        if name.startswith("p") and name[1:].isdigit():
            q = int(name[1:]) / 100
            return [b.p(q) for b in self.buckets]
        if name.startswith("a") and name[1:].isdigit():  # sent → answered
            q = int(name[1:]) / 100
            return [b.answer.get(q) for b in self.buckets]
        return [getattr(b, name) for b in self.buckets]


def _window(*, minutes: int, step_s: int, now: datetime) -> tuple[int, int]:
    """The first and last bucket number: the newest bucket holds `now`."""
    last = int(now.timestamp()) // step_s
    return last - (minutes * 60) // step_s + 1, last


def _fill(bucket: Bucket, counts: Counter) -> None:
    for name, metric in SOURCES.items():
        setattr(bucket, name, max(0, counts.get(metric, 0)))
    bucket.acked, bucket.latency = quantiles(counts, LATENCY_BUCKETS_S, "lat:")
    bucket.answered, bucket.answer = quantiles(counts, ANSWER_BUCKETS_S, "ans:")


def message_stats(*, minutes: int, step_s: int, now: datetime | None = None
                  ) -> MessageStats:
    """Per `step_s` bucket over the last `minutes` (the newest bucket holds `now`): messages,
    retries, duplicates, held, BUSY, UNDELIVERABLE, FAILED, EXPIRED, TASK_ERROR and the
    latency percentiles; the window's counts summed, and the latency percentiles of its last
    HEADLINE_S (now, not an hour's blur). One read of the kept numbers."""
    if step_s not in STEPS or (minutes * 60) % step_s or HEADLINE_S % step_s:
        raise ValueError("the window and the headline must be whole numbers of buckets of "
                         f"{' or '.join(map(str, STEPS))} s")
    now = now or timezone.now()
    first, last = _window(minutes=minutes, step_s=step_s, now=now)
    recent_first = max(first, last - HEADLINE_S // step_s + 1)
    kept = rollup_buckets(scope=ALL, subject="", step=step_s, first=first, last=last)
    since = bucket_at(first, step_s)
    buckets = []
    recent: Counter = Counter()
    whole: Counter = Counter()
    empty: Counter = Counter()
    for b in range(first, last + 1):
        start = bucket_at(b, step_s)
        elapsed = min(step_s, (now - start).total_seconds())
        bucket = Bucket(start=start, seconds=max(elapsed, 0.0))
        counts = kept.get(b, empty)
        _fill(bucket, counts)
        buckets.append(bucket)
        whole.update(counts)
        if b >= recent_first:
            recent.update({k: v for k, v in counts.items() if k.startswith(("lat:", "ans:"))})
    totals = Bucket(start=since, seconds=max((now - since).total_seconds(), 0.0))
    _fill(totals, whole)
    # The headline latency is the last minutes' only.
    totals.acked, totals.latency = quantiles(recent, LATENCY_BUCKETS_S, "lat:")
    totals.answered, totals.answer = quantiles(recent, ANSWER_BUCKETS_S, "ans:")
    return MessageStats(since=since, until=now, step_s=step_s, buckets=buckets,
                        totals=totals, latency_since=bucket_at(recent_first, step_s))
