"""Reading and keeping the per-bucket numbers of messages/ledger.py (`a2a_rollup`).

A read sums the rows of a few keys over a range of buckets, through an index that starts
with the key: its cost is the buckets of the window, whatever the traffic in them. Writers
write at each scope's finest width only; beat folds each key's rows into one at every width
(`rollups_fold`) and drops buckets past their keep.

Percentiles come from histograms, so they are approximate: a value is known to lie between
two bucket bounds (`LATENCY_BUCKETS_S`, `ANSWER_BUCKETS_S`) and is placed linearly between
them, as Prometheus's histogram_quantile does. The pages say so, with the bounds.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from messages.ledger import (
    AGENT,
    ALL,
    ANSWER_BUCKETS_S,
    FINEST,
    NODE,
    STEPS_ALL,
    STEPS_SCOPED,
    status_metric,
)
from messages.models import Rollup, Status
from messages.protocol import MessageType
from reachconsole.core.errors import ConsoleError
from reachconsole.core.metrics import LATENCY_BUCKETS_S

PERCENTILES = (0.5, 0.95, 0.99)
# The windows stats are asked for, and the bucket width each is read at.
WINDOWS: dict[str, tuple[int, int]] = {
    "5m": (300, 60), "15m": (900, 60), "1h": (3600, 60), "6h": (21600, 3600),
    "24h": (86400, 3600),
}
DEFAULT_WINDOW = "15m"
# How long each width's buckets are kept: the longest window read at it, and some.
KEEP_S = {15: 2 * 3600, 60: 26 * 3600, 3600: 8 * 86400}
FOLD_BATCH = 20_000


class WindowError(ConsoleError):
    code = "bad_window"
    status = 400


def window_read(value: str | None) -> str:
    """A window's name as given, or the default; WindowError names the choices."""
    value = (value or DEFAULT_WINDOW).strip()
    if value not in WINDOWS:
        raise WindowError(f"There is no window {value[:20]!r}: choose one of "
                          f"{', '.join(WINDOWS)}.")
    return value


def bucket_at(bucket: int, step: int) -> datetime:
    return datetime.fromtimestamp(bucket * step, tz=UTC)


def percentile(counts: Counter, bounds: tuple[float, ...], prefix: str, q: float
               ) -> float | None:
    """The q-quantile of a histogram kept as `prefix{i}` counts (i: the first bound that
    holds the value; len(bounds) is +Inf), interpolated inside its bucket. None without
    values; a quantile in the +Inf bucket is the largest bound (at least that)."""
    return quantiles(counts, bounds, prefix, (q,))[1][q]


def _per_bucket(counts: Counter, bounds: tuple[float, ...], prefix: str) -> list[int]:
    return [max(0, counts.get(f"{prefix}{i}", 0)) for i in range(len(bounds) + 1)]


def _walk(per: list[int], q: float) -> tuple[int, float]:
    """The bucket that holds the q-quantile of a histogram with values (`per`: counts per
    bucket), and how far into it the rank lies (0..1)."""
    rank, seen = q * sum(per), 0
    for i, n in enumerate(per):
        if n and seen + n >= rank:
            return i, max(0.0, rank - seen) / n
        seen += n
    return len(per) - 1, 1.0


def quantiles(counts: Counter, bounds: tuple[float, ...], prefix: str,
              qs: tuple[float, ...] = PERCENTILES) -> tuple[int, dict[float, float | None]]:
    """(how many values, {q: quantile}) of one histogram: its buckets read once for all
    of `qs` (a page computes hundreds of these)."""
    per = _per_bucket(counts, bounds, prefix)
    total = sum(per)
    out: dict[float, float | None] = {}
    for q in qs:
        if not total:
            out[q] = None
            continue
        i, share = _walk(per, q)
        low = bounds[i - 1] if i else 0.0
        out[q] = bounds[-1] if i == len(bounds) else low + (bounds[i] - low) * share
    return total, out


def quantile_bucket(counts: Counter, bounds: tuple[float, ...], prefix: str, q: float
                    ) -> tuple[float, float | None] | None:
    """The bounds of the bucket the q-quantile lies in, as (low, high), high None above
    the last bound: what is known of it (quantiles() places it inside by interpolation).
    None without values."""
    per = _per_bucket(counts, bounds, prefix)
    if not sum(per):
        return None
    i, _ = _walk(per, q)
    return (bounds[i - 1] if i else 0.0), (bounds[i] if i < len(bounds) else None)


def duration_words(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    return f"{seconds:.3g} s"


def bounds_words(bounds: tuple[float, ...]) -> str:
    """A histogram's bucket bounds as a page says them: "5 ms, 10 ms, … 30 s"."""
    return ", ".join(duration_words(b) for b in bounds)


def histogram_total(counts: Counter, bounds: tuple[float, ...], prefix: str) -> int:
    return sum(max(0, counts.get(f"{prefix}{i}", 0)) for i in range(len(bounds) + 1))


def _kept(*, scope: str, step: int, first: int, last: int) -> Q:
    """The rows that hold a scope's numbers at `step`, buckets first..last: those of that
    width, and the writers' rows at the scope's finest width that the fold has not added to
    the wider ones yet (messages/ledger.py writes only those). One statement reads both, so
    a fold that commits meanwhile is seen whole or not at all: nothing counted twice."""
    kept = Q(step=step, scope=scope, bucket__gte=first, bucket__lte=last)
    finest = FINEST[scope]
    if step != finest:
        if step % finest:
            raise ValueError(f"{step} s is not a whole number of {finest} s buckets")
        per = step // finest
        kept |= Q(step=finest, scope=scope, folded=False, bucket__gte=first * per,
                  bucket__lte=(last + 1) * per - 1)
    return kept


def rollup_buckets(*, scope: str, subject: str, step: int, first: int, last: int
                   ) -> dict[int, Counter]:
    """Every metric of one subject, per bucket first..last."""
    rows = (Rollup.objects.filter(_kept(scope=scope, step=step, first=first, last=last),
                                  subject=subject)
            .values_list("step", "bucket", "metric").annotate(n=Sum("n")).order_by())
    out: dict[int, Counter] = defaultdict(Counter)
    for width, bucket, metric, n in rows:
        out[bucket * width // step][metric] += n
    return out


def rollup_totals(*, scope: str, step: int, first: int, last: int,
                  subjects: Iterable[str] | None = None,
                  metrics: Iterable[str] | None = None) -> dict[str, Counter]:
    """Every subject of a scope (or those named), its metrics summed over buckets
    first..last: one grouped read."""
    qs = Rollup.objects.filter(_kept(scope=scope, step=step, first=first, last=last))
    if subjects is not None:
        qs = qs.filter(subject__in=list(subjects))
    if metrics is not None:
        qs = qs.filter(metric__in=list(metrics))
    out: dict[str, Counter] = defaultdict(Counter)
    for subject, metric, n in (qs.values_list("subject", "metric").annotate(n=Sum("n"))
                               .order_by()):
        out[subject][metric] += n
    return out


def window_buckets(window: str, *, now: datetime) -> tuple[int, int, int]:
    """(step, first, last): the buckets that cover the window; the first may begin a little
    before it (up to one bucket), as the stats say with `since`."""
    seconds, step = WINDOWS[window]
    last = int(now.timestamp()) // step
    first = int((now - timedelta(seconds=seconds)).timestamp()) // step
    return step, first, last


# --- one subject's numbers (the stats API, the agent and node pages, the roster) ----------
# Outcomes counted as failures of the work, and as answers at all.
FAILED_OUTCOMES = (Status.TASK_ERROR, Status.EXPIRED, Status.UNDELIVERABLE, Status.NACKED,
                   Status.BUSY, Status.FAILED)


@dataclass
class SubjectStats:
    window: str
    since: datetime
    until: datetime
    step: int
    counts: Counter = field(default_factory=Counter)

    def n(self, status: str) -> int:
        return max(0, self.counts.get(status_metric(status), 0))

    @property
    def completed(self) -> int:
        # A console agent's answer is counted by its outcome already (messages/ledger.py).
        return self.n(Status.COMPLETED)

    @property
    def finished(self) -> int:
        return self.completed + sum(self.n(s) for s in FAILED_OUTCOMES)

    @property
    def success_rate(self) -> float | None:
        """Completed among the transmissions that ended (None when none did)."""
        return self.completed / self.finished if self.finished else None

    def latency(self, q: float) -> float | None:
        """publish → ACK, seconds (approximate)."""
        return percentile(self.counts, LATENCY_BUCKETS_S, "lat:", q)

    def answer(self, q: float) -> float | None:
        """sent → answered, seconds (approximate)."""
        return percentile(self.counts, ANSWER_BUCKETS_S, "ans:", q)

    def as_json(self) -> dict:
        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000, 1)

        rate = self.success_rate
        return {
            "window": self.window, "since": self.since.isoformat(),
            "until": self.until.isoformat(), "bucketSeconds": self.step,
            "tasks": max(0, self.counts.get("tasks", 0)),
            "requests": max(0, self.counts.get("requests", 0)),
            "completed": self.completed, "taskErrors": self.n(Status.TASK_ERROR),
            "expired": self.n(Status.EXPIRED), "undeliverable": self.n(Status.UNDELIVERABLE),
            "nacked": self.n(Status.NACKED), "busy": self.n(Status.BUSY),
            "failed": self.n(Status.FAILED), "canceled": self.n(Status.CANCELED),
            "retries": max(0, self.counts.get("retries", 0)),
            "awaitingResponse": self.n(Status.ACKED),
            "successRate": None if rate is None else round(rate, 4),
            "publishToAckMs": {f"p{round(q * 100)}": ms(self.latency(q)) for q in PERCENTILES},
            "sentToAnsweredMs": {f"p{round(q * 100)}": ms(self.answer(q))
                                 for q in PERCENTILES},
            "acked": histogram_total(self.counts, LATENCY_BUCKETS_S, "lat:"),
            "answered": histogram_total(self.counts, ANSWER_BUCKETS_S, "ans:"),
            "latencyBoundsMs": [round(b * 1000, 3) for b in LATENCY_BUCKETS_S],
            "answerBoundsMs": [round(b * 1000, 3) for b in ANSWER_BUCKETS_S],
        }


def subject_stats(*, scope: str, subject: str, window: str = DEFAULT_WINDOW,
                  now: datetime | None = None) -> SubjectStats:
    now = now or timezone.now()
    step, first, last = window_buckets(window, now=now)
    counts = rollup_totals(scope=scope, step=step, first=first, last=last,
                           subjects=[subject]).get(subject, Counter())
    return SubjectStats(window=window, since=bucket_at(first, step), until=now, step=step,
                        counts=counts)


def subjects_stats(*, scope: str, window: str = DEFAULT_WINDOW,
                   subjects: Iterable[str] | None = None,
                   now: datetime | None = None) -> dict[str, SubjectStats]:
    """Every subject's stats of one scope in one read (the roster's columns, the alarms)."""
    now = now or timezone.now()
    step, first, last = window_buckets(window, now=now)
    since = bucket_at(first, step)
    return {subject: SubjectStats(window=window, since=since, until=now, step=step,
                                  counts=counts)
            for subject, counts in rollup_totals(scope=scope, step=step, first=first,
                                                 last=last, subjects=subjects).items()}


# --- keeping the table small ---------------------------------------------------------------
@dataclass
class FoldResult:
    read: int = 0
    written: int = 0
    dropped: int = 0


def _widths(step: int, scope: str) -> tuple[int, ...]:
    """The widths one unfolded row is added to: a row at its scope's finest width, to every
    width the scope is kept at; a wider one (written so by an earlier version, which wrote
    each width itself), to its own."""
    if step != FINEST[scope]:
        return (step,)
    return STEPS_ALL if scope == ALL else STEPS_SCOPED


def rollups_fold(*, now: datetime | None = None, batch: int = FOLD_BATCH) -> FoldResult:
    """Fold the rows written since the last fold into one row per key and width, and drop
    buckets past their keep. Rows are claimed SKIP LOCKED: two folds at once take different
    rows, and a sum of sums is the same sum, so nothing is counted twice or lost."""
    now = now or timezone.now()
    result = FoldResult()
    with transaction.atomic():
        fresh = list(Rollup.objects.select_for_update(skip_locked=True)
                     .filter(folded=False).order_by("id")
                     .values_list("id", "step", "bucket", "scope", "subject", "metric", "n")
                     [:batch])
        if fresh:
            sums: Counter = Counter()
            ids = []
            for pk, step, bucket, scope, subject, metric, n in fresh:
                for width in _widths(step, scope):
                    sums[(width, bucket * step // width, scope, subject, metric)] += n
                ids.append(pk)
            # The folded row of each key, if it has one: summed in, and replaced.
            by_subject: dict[tuple, set] = defaultdict(set)
            for step, bucket, scope, subject, metric in list(sums):
                by_subject[(step, scope, subject)].add((bucket, metric))
            for (step, scope, subject), wanted in by_subject.items():
                buckets = {b for b, _ in wanted}
                for pk, bucket, metric, n in (
                        Rollup.objects.select_for_update(skip_locked=True)
                        .filter(step=step, scope=scope, subject=subject, folded=True,
                                bucket__gte=min(buckets), bucket__lte=max(buckets))
                        .values_list("id", "bucket", "metric", "n")):
                    if (bucket, metric) in wanted:
                        sums[(step, bucket, scope, subject, metric)] += n
                        ids.append(pk)
            for start in range(0, len(ids), 5000):
                Rollup.objects.filter(pk__in=ids[start:start + 5000]).delete()
            folded = [Rollup(step=step, bucket=bucket, scope=scope, subject=subject,
                             metric=metric, n=n, folded=True)
                      for (step, bucket, scope, subject, metric), n in sorted(sums.items())
                      if n]
            Rollup.objects.bulk_create(folded, batch_size=2000)
            result.read, result.written = len(ids), len(folded)
    for step, keep in KEEP_S.items():
        oldest = int(now.timestamp() - keep) // step
        for scope in (ALL, AGENT, NODE):
            result.dropped += Rollup.objects.filter(step=step, scope=scope,
                                                    bucket__lt=oldest).delete()[0]
    return result


@dataclass(slots=True)
class _Counted:
    """What the ledger reads of a row, without a model instance per row (a rebuild reads
    millions)."""

    created_at: datetime
    updated_at: datetime
    message_type: str
    direction: str
    status: str
    held: bool
    to_agent_id: str
    target_node_id: str
    attempt: int
    resend_of_id: int | None
    published_at: datetime | None
    acked_at: datetime | None
    finished_at: datetime | None
    duplicate: bool

    @property
    def payload(self) -> dict:
        return {"duplicate": True} if self.duplicate else {}


_COUNTED = [f for f in _Counted.__dataclass_fields__ if f != "duplicate"]


def rollups_rebuild(*, since: datetime, until: datetime | None = None, chunk: int = 5000
                    ) -> int:
    """Count again, from the rows, the numbers of messages created from `since` (rounded
    down to the hour) to `until`: for a console upgraded from a version that kept none, or
    rows written around the services. The buckets of that span are replaced in one
    transaction, so readers see the old numbers or the new ones; stop beat meanwhile (its
    fold could put back rows this deletes). Held counts are not rebuilt: a row does not
    keep whether it was held. Returns the rows read."""
    from django.db.models import BooleanField, Case, Q, Value, When

    from messages.ledger import Ledger
    from messages.models import Message

    until = until or timezone.now()
    start = datetime.fromtimestamp(int(since.timestamp()) // 3600 * 3600, tz=UTC)
    read = 0
    with transaction.atomic():
        for step in STEPS_ALL:
            Rollup.objects.filter(step=step, bucket__gte=int(start.timestamp()) // step,
                                  bucket__lte=int(until.timestamp()) // step).delete()
        duplicate = Case(When(Q(message_type=MessageType.ACK, payload__duplicate=True),
                              then=Value(True)),
                         default=Value(False), output_field=BooleanField())
        rows = (Message.objects.filter(created_at__gte=start, created_at__lt=until)
                .annotate(duplicate=duplicate).order_by("created_at", "id")
                .values_list(*_COUNTED, "duplicate"))
        ledger = Ledger()
        batch: list[_Counted] = []
        for values in rows.iterator(chunk_size=chunk):
            batch.append(_Counted(*values))
            if len(batch) >= chunk:
                ledger.inserted(batch, rebuilt=True)
                ledger.write()
                read += len(batch)
                batch = []
        ledger.inserted(batch, rebuilt=True)
        ledger.write()
        read += len(batch)
    return read
