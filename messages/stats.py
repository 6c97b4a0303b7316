"""Message statistics over time for the overview page: how much moved, how fast it was
acknowledged, and what went wrong, per time bucket of the last minutes or hour.

Read from `a2a_message`, the authority on what happened to a message, in one grouped pass
over the `a2a_timeline` index (`created_at`): the cost is the rows of the window, never the
whole table. A row is counted in the bucket it was created in, with the status it has now
(a request sent at 10:01 and found UNDELIVERABLE is an UNDELIVERABLE of 10:01). The shared
counters (reachconsole.core.metrics) are totals since they started and cannot be cut into
minutes, so they are not used here.

Latency is publish → ACK of our task requests (`acked_at - published_at`), as in the
`reach_delivery_latency_seconds` histogram: per bucket, and as a headline over the last
HEADLINE_S whatever the window (what it is now). PostgreSQL computes the percentiles itself
(`percentile_cont`); SQLite has no such aggregate, so the newest LATENCY_SAMPLE values of each
bucket are read and the same interpolation is done in Python.

A page that refreshes every few seconds need not re-count a whole hour each time: the
counts and percentiles of buckets that ended a while ago are kept in the cache for a minute
and shared by every reader (`keep=True`), so the table is read for the last few minutes
only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from django.core.cache import cache
from django.db import connection
from django.db.models import Count, F, Func, IntegerField, Q, Window
from django.db.models.functions import RowNumber
from django.utils import timezone

from messages.models import Direction, Message, Status

log = logging.getLogger(__name__)

TASK_REQUEST = "TASK_REQUEST"
# SQLite only: latency values read per bucket (the newest); PostgreSQL uses them all.
LATENCY_SAMPLE = 1000
PERCENTILES = (0.5, 0.95, 0.99)

# A bucket that ended this long ago has (nearly) stopped changing: its counts are kept in
# the cache for KEPT_FOR_S and shared by every reader (message_stats(keep=True)).
SETTLED_AFTER_S = 120
KEPT_FOR_S = 60
# The headline latency is over the last 5 minutes, whatever the window: what it is now.
HEADLINE_S = 300

# The counts kept per bucket, in the order the page shows them.
COUNTS = ("messages", "retries", "duplicates", "held", "busy", "undeliverable", "failed")


def pg_bucket(column: str, step_s: int) -> str:
    # date_part is float8 arithmetic; EXTRACT answers numeric since PostgreSQL 14, whose
    # division costs about twice the whole scan of an hour's rows.
    return f"floor(date_part('epoch', {column}) / {int(step_s)})::bigint"


class EpochBucket(Func):
    """The `step_s`-second bucket a timestamp falls in, as whole epoch seconds / step_s:
    the same integer on both backends, so buckets line up with Python's."""

    output_field = IntegerField()

    def __init__(self, expression, step_s: int, **extra):
        super().__init__(expression, **extra)
        self.step_s = int(step_s)

    def as_sql(self, compiler, connection, **extra):
        raise NotImplementedError(f"no time buckets on {connection.vendor}")

    def as_postgresql(self, compiler, connection, **extra):
        sql, params = compiler.compile(self.source_expressions[0])
        return pg_bucket(sql, self.step_s), params

    def as_sqlite(self, compiler, connection, **extra):
        sql, params = compiler.compile(self.source_expressions[0])
        # Django stores UTC text ('YYYY-MM-DD HH:MM:SS.ffffff'); '%%s' becomes '%s' there.
        return f"(CAST(strftime('%%s', {sql}) AS INTEGER) / {self.step_s})", params


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
    acked: int = 0  # task requests with a publish → ACK time
    latency: dict[float, float | None] = field(default_factory=dict)  # percentile → seconds

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

    @property
    def window_s(self) -> float:
        return (self.until - self.since).total_seconds()

    def series(self, name: str) -> list[float | None]:
        """One value per bucket, oldest first: a count, `rate`, or `p50`/`p95`/`p99`."""
        if name.startswith("p") and name[1:].isdigit():
            q = int(name[1:]) / 100
            return [b.p(q) for b in self.buckets]
        return [getattr(b, name) for b in self.buckets]


def percentile_cont(values: Sequence[float], q: float) -> float | None:
    """PostgreSQL's percentile_cont: linear interpolation between the closest ranks of the
    sorted values (`values` must be sorted)."""
    if not values:
        return None
    position = q * (len(values) - 1)
    low, high = math.floor(position), math.ceil(position)
    return values[low] + (values[high] - values[low]) * (position - low)


def _window(*, minutes: int, step_s: int, now: datetime) -> tuple[int, int]:
    """The first and last bucket number: the newest bucket holds `now`."""
    last = int(now.timestamp()) // step_s
    return last - (minutes * 60) // step_s + 1, last


def _at(bucket: int, step_s: int) -> datetime:
    return datetime.fromtimestamp(bucket * step_s, tz=UTC)


def _ours() -> Q:
    return Q(direction=Direction.SEND, message_type=TASK_REQUEST)


def _counts(rows, *, step_s: int) -> dict[int, dict]:
    grouped = (
        rows.annotate(b=EpochBucket("created_at", step_s)).values("b").annotate(
            messages=Count("id"),
            # A new attempt of a task is a new row (attempt 2 and later), as tally counts it.
            retries=Count("id", filter=_ours() & Q(attempt__gt=1)),
            # Repeats absorbed by idempotency are answered ACK {"duplicate": true}: ours to a
            # repeated request, the receivers' to our retransmissions.
            duplicates=Count("id", filter=Q(message_type="ACK", payload__duplicate=True)),
            # Still held now (a held row keeps SENT until it is released).
            held=Count("id", filter=Q(held=True, status=Status.SENT)),
            busy=Count("id", filter=Q(status=Status.BUSY)),
            undeliverable=Count("id", filter=Q(status=Status.UNDELIVERABLE)),
            failed=Count("id", filter=Q(status=Status.FAILED)),
        ).order_by()
    )
    return {row.pop("b"): row for row in grouped}


def _kept_key(step_s: int, bucket: int) -> str:
    return f"a2a-stats:{step_s}:{bucket}"


def stats_forget(*, step_s: int, buckets: range) -> None:
    """Drop the kept buckets (tests, or after a deliberate change)."""
    cache.delete_many([_kept_key(step_s, b) for b in buckets])


def _latency_rows(since: datetime, until: datetime) -> Q:
    return (_ours() & Q(created_at__gte=since, created_at__lt=until,
                        published_at__isnull=False, acked_at__isnull=False))


# {bucket} is EpochBucket's SQL with the step written in (an int), so the select list and
# the grouping name the very same expression. The () grouping set is the headline: its
# FILTER keeps the rows since %(recent)s.
_PG_LATENCY = """
SELECT {bucket} AS b, count(*),
       percentile_cont(%(q)s::float8[]) WITHIN GROUP (ORDER BY {latency}),
       count(*) FILTER (WHERE created_at >= %(recent)s),
       percentile_cont(%(q)s::float8[]) WITHIN GROUP (ORDER BY {latency})
           FILTER (WHERE created_at >= %(recent)s)
FROM a2a_message
WHERE created_at >= %(since)s AND created_at < %(until)s AND direction = %(direction)s
  AND message_type = %(type)s AND published_at IS NOT NULL AND acked_at IS NOT NULL
GROUP BY GROUPING SETS (({bucket}), ())
"""
Latencies = dict[int | None, tuple[int, dict]]  # bucket (None: the headline) → (n, q → s)


def _no_values() -> dict:
    return dict.fromkeys(PERCENTILES)


def _latency_postgresql(since: datetime, until: datetime, step_s: int, recent: datetime
                        ) -> Latencies:
    """One pass: the grouping sets give each bucket and the headline from the same rows."""
    sql = _PG_LATENCY.format(bucket=pg_bucket("created_at", step_s),
                             latency="greatest(0, date_part('epoch', acked_at - published_at))")
    with connection.cursor() as cursor:
        cursor.execute(sql, {"q": list(PERCENTILES), "since": since, "until": until,
                             "recent": recent, "direction": Direction.SEND,
                             "type": TASK_REQUEST})
        out: Latencies = {}
        for b, n, values, recent_n, recent_values in cursor.fetchall():
            if b is None:
                n, values = recent_n, recent_values
            # Over no rows at all (the headline's grouping set still answers): NULL.
            out[b] = (n, dict(zip(PERCENTILES, values, strict=True)) if values
                      else _no_values())
        return out


def _latency_sampled(since: datetime, until: datetime, step_s: int, recent: datetime
                     ) -> Latencies:
    bucket = EpochBucket("created_at", step_s)
    rows = (Message.objects.filter(_latency_rows(since, until))
            .annotate(b=bucket, place=Window(RowNumber(), partition_by=[bucket],
                                             order_by=F("id").desc()))
            .filter(place__lte=LATENCY_SAMPLE)
            .values_list("b", "created_at", "published_at", "acked_at").order_by())
    values: dict[int, list[float]] = {}
    headline: list[float] = []
    for b, created, published, acked in rows:
        latency = max(0.0, (acked - published).total_seconds())
        values.setdefault(b, []).append(latency)
        if created >= recent:
            headline.append(latency)
    out: Latencies = {}
    for b, found in values.items():
        found.sort()
        out[b] = (len(found), {q: percentile_cont(found, q) for q in PERCENTILES})
    headline.sort()
    out[None] = (len(headline), {q: percentile_cont(headline, q) for q in PERCENTILES})
    return out


def _read(*, first: int, last: int, step_s: int, recent: datetime
          ) -> tuple[dict[int, dict], Latencies]:
    """Counts and latencies of buckets first..last, read from the table."""
    since, until = _at(first, step_s), _at(last + 1, step_s)
    counts = _counts(Message.objects.filter(created_at__gte=since, created_at__lt=until),
                     step_s=step_s)
    if connection.vendor == "postgresql":
        return counts, _latency_postgresql(since, until, step_s, recent)
    return counts, _latency_sampled(since, until, step_s, recent)


def _read_kept(*, first: int, last: int, step_s: int, now: datetime, recent_first: int
               ) -> tuple[dict[int, dict], Latencies]:
    """As _read, but the buckets that ended SETTLED_AFTER_S ago come from the cache when
    another reader computed them within KEPT_FOR_S: an hour's page reads the table for its
    last few minutes only, whoever looks and however often."""
    settled_last = min(last, (int(now.timestamp()) - SETTLED_AFTER_S) // step_s - 1)
    settled = range(first, settled_last + 1)
    keys = {b: _kept_key(step_s, b) for b in settled}
    try:
        found = cache.get_many(list(keys.values()))
    except Exception as exc:  # the cache (Redis) is down: read it all from the table
        log.warning("message statistics: cache unavailable (%s); reading the table", exc)
        found = {}
    kept = {b: found[key] for b, key in keys.items() if key in found}
    start = next((b for b in settled if b not in kept), settled_last + 1)
    # The headline's minutes are always read: its percentiles need every value.
    start = max(first, min(start, recent_first))
    counts, latencies = _read(first=start, last=last, step_s=step_s,
                              recent=_at(recent_first, step_s))
    fresh = {keys[b]: (counts.get(b, {}), latencies.get(b, (0, _no_values())))
             for b in range(start, settled_last + 1) if b not in kept}
    if fresh:
        try:
            cache.set_many(fresh, timeout=KEPT_FOR_S)
        except Exception as exc:
            log.warning("message statistics: could not keep buckets (%s)", exc)
    for b, (kept_counts, kept_latency) in kept.items():
        if b < start:
            counts[b], latencies[b] = kept_counts, kept_latency
    return counts, latencies


def message_stats(*, minutes: int, step_s: int, now: datetime | None = None,
                  keep: bool = False) -> MessageStats:
    """Per `step_s` bucket over the last `minutes` (the newest bucket holds `now`): messages,
    retries, duplicates, held, BUSY, UNDELIVERABLE and FAILED, and the publish → ACK
    percentiles of our task requests; the window's counts summed, and the latency
    percentiles of its last HEADLINE_S (now, not an hour's blur). Two grouped reads over the
    window's rows; with `keep`, settled buckets come from the cache (see _read_kept), so a
    count there may be up to KEPT_FOR_S old (a request sent then that expires later)."""
    if step_s <= 0 or (minutes * 60) % step_s or HEADLINE_S % step_s:
        raise ValueError("the window and the headline must be whole numbers of buckets")
    now = now or timezone.now()
    first, last = _window(minutes=minutes, step_s=step_s, now=now)
    recent_first = max(first, last - HEADLINE_S // step_s + 1)
    if keep:
        counts, latency = _read_kept(first=first, last=last, step_s=step_s, now=now,
                                     recent_first=recent_first)
    else:
        counts, latency = _read(first=first, last=last, step_s=step_s,
                                recent=_at(recent_first, step_s))
    since = _at(first, step_s)
    buckets = []
    for b in range(first, last + 1):
        start = _at(b, step_s)
        elapsed = min(step_s, (now - start).total_seconds())
        bucket = Bucket(start=start, seconds=max(elapsed, 0.0), **counts.get(b, {}))
        bucket.acked, bucket.latency = latency.get(b, (0, {}))
        buckets.append(bucket)
    totals = Bucket(start=since, seconds=max((now - since).total_seconds(), 0.0))
    for name in COUNTS:
        setattr(totals, name, sum(getattr(b, name) for b in buckets))
    totals.acked, totals.latency = latency.get(None, (0, {}))
    return MessageStats(since=since, until=now, step_s=step_s, buckets=buckets,
                        totals=totals, latency_since=_at(recent_first, step_s))
