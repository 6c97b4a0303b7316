"""What the console counts, kept in the cache (Redis in production) so that every process
adds to the same numbers and a scrape of any one Daphne shows the whole console's:

- counters named `name` or `name:label` (monotonic; reachconsole/collector.py turns them into
  Prometheus families: `rejected:bad_json` → `reach_rejected_total{reason="bad_json"}`);
- histograms as one counter per bucket (`hist:<name>:le=<bound>`, `…:sum_us`, `…:count`);
- per-second delivery tallies for readiness (`delivery_rate`), which expire by themselves.

Writers add in batches, never a round trip per message: `LocalCounter` (an owner loop flushes
it), or `counters_add_later` / `delivery_add_later`, which this process hands over at most
once a second from a thread of its own. Unlike prometheus-client's multiprocess mode (one
directory on one machine) this works for processes on many machines.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from django.core.cache import cache

log = logging.getLogger(__name__)

PREFIX = "metric:"
# The names of the counters, so a scrape can read them all: slot n of the index names one
# counter. A counter takes its slot once (`cache.add` of its marker decides who), so two
# processes that count a new name at once never overwrite each other's index entry.
SLOTS_KEY = "metric-slots"
SLOT_PREFIX = "metric-slot:"
MARKER_PREFIX = "metric-name:"
FLUSH_EVERY_S = 1.0

# publish → ACK, in seconds: from a loopback round trip to a receiver at its ACK timeout.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
HIST_PREFIX = "hist:"

# Delivery tallies: one key per second and kind, kept long enough to be read as the window.
DELIVERY_PREFIX = "delivery:"
DELIVERY_TTL_S = 120


# --- counters -------------------------------------------------------------------------------
_registered: set[str] = set()  # names this process made sure have a slot


def _register(name: str) -> None:
    if name in _registered:
        return
    if cache.add(MARKER_PREFIX + name, 1, timeout=None):
        cache.add(SLOTS_KEY, 0, timeout=None)
        cache.set(f"{SLOT_PREFIX}{cache.incr(SLOTS_KEY)}", name, timeout=None)
    _registered.add(name)


def _incr(key: str, value: int, *, timeout: float | None) -> bool:
    """Add `value`; False when the key was missing (new, expired, or the cache emptied)."""
    try:
        cache.incr(key, value)
        return True
    except ValueError:
        cache.add(key, 0, timeout=timeout)
        cache.incr(key, value)
        return False


def _write_counters(counts: Mapping[str, int]) -> None:
    """Add to the shared counters; on an error, `counts` keeps what was not added yet."""
    done = []
    try:
        for name, value in counts.items():
            if value:
                _register(name)
                if not _incr(PREFIX + name, value, timeout=None):
                    # New, or the cache lost it (a Redis restart empties the slots too):
                    # take a slot again, or scrapes would no longer list it.
                    _registered.discard(name)
                    _register(name)
            done.append(name)
    finally:
        if isinstance(counts, Counter):
            for name in done:
                del counts[name]


def counters_add(counts: Mapping[str, int]) -> None:
    """Add to counters named `name` or `name:label`, now (one cache round trip or two per
    name: call it with a batch)."""
    if not counts:
        return
    try:
        _write_counters(dict(counts))
    except Exception:  # counting must never break the path that counts
        log.exception("could not record counters")


def counters_snapshot() -> dict[str, int]:
    """Every counter and its value, as all processes together counted it."""
    slots = int(cache.get(SLOTS_KEY) or 0)
    names = set(cache.get_many([f"{SLOT_PREFIX}{n}" for n in range(1, slots + 1)]).values())
    values = cache.get_many([PREFIX + name for name in names])
    return {name: int(values.get(PREFIX + name, 0)) for name in sorted(names)}


class LocalCounter(Counter):
    """Counts in memory and hands them to the shared counters at most once per flush."""

    def flush(self) -> None:
        counts = dict(self)
        self.clear()
        counters_add(counts)


# --- histograms -----------------------------------------------------------------------------
def _bound(le: float) -> str:
    return "+Inf" if math.isinf(le) else repr(float(le))


def histogram_counts(name: str, values: Iterable[float],
                     buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> Counter:
    """The counter increments that observe `values` in histogram `name` (not cumulative:
    each value in the first bucket that holds it)."""
    out: Counter = Counter()
    for value in values:
        le = next((b for b in buckets if value <= b), math.inf)
        out[f"{HIST_PREFIX}{name}:le={_bound(le)}"] += 1
        out[f"{HIST_PREFIX}{name}:sum_us"] += round(value * 1_000_000)
        out[f"{HIST_PREFIX}{name}:count"] += 1
    return out


@dataclass(frozen=True)
class Histogram:
    buckets: list[tuple[str, int]]  # (upper bound as Prometheus writes it, cumulative count)
    sum_s: float
    count: int


def histogram_read(snapshot: Mapping[str, int], name: str,
                   buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> Histogram:
    """Histogram `name` out of a counters snapshot, cumulative, every bucket present."""
    head = f"{HIST_PREFIX}{name}:"
    per_bound = {float(key[len(head) + 3:]): value for key, value in snapshot.items()
                 if key.startswith(head + "le=")}
    cumulative, out = 0, []
    for le in sorted({*buckets, *per_bound} - {math.inf}):
        cumulative += per_bound.get(le, 0)
        out.append((_bound(le), cumulative))
    count = int(snapshot.get(head + "count", 0))
    out.append(("+Inf", max(count, cumulative + per_bound.get(math.inf, 0))))
    return Histogram(buckets=out, sum_s=snapshot.get(head + "sum_us", 0) / 1_000_000,
                     count=out[-1][1])


# --- delivery tallies -----------------------------------------------------------------------
def _delivery_key(kind: str, second: int) -> str:
    return f"{DELIVERY_PREFIX}{kind}:{second}"


def delivery_add_later(*, published: Mapping[int, int] | None = None,
                       answered: Mapping[int, int] | None = None) -> None:
    """Transmissions the broker took, and of those the ones answered, by the second the
    broker took them (epoch seconds)."""
    tallies: Counter = Counter()
    for kind, by_second in (("pub", published or {}), ("ans", answered or {})):
        for second, n in by_second.items():
            tallies[_delivery_key(kind, second)] += n
    _pending.add(tallies=tallies)


@dataclass(frozen=True)
class DeliveryRate:
    """The lowest share of transmissions answered in any judged second (None: no traffic),
    and each judged second as (epoch second, published, answered)."""

    lowest: float | None
    seconds: list[tuple[int, int, int]]

    def lowest_of(self, *, at_least: int) -> float | None:
        """The lowest share among the seconds with at least `at_least` transmissions."""
        shares = [min(a, p) / p for _, p, a in self.seconds if p >= max(at_least, 1)]
        return min(shares) if shares else None


def delivery_rate(*, now: float | None = None, settle_s: float,
                  window_s: int = 10) -> DeliveryRate:
    """The last `window_s` whole seconds whose transmissions had `settle_s` to be answered:
    a second ending less than `settle_s` ago is not judged yet (its answers may be in flight)."""
    now = time.time() if now is None else now
    newest = math.floor(now - settle_s) - 1
    seconds = range(newest - window_s + 1, newest + 1)
    keys = [_delivery_key(kind, s) for s in seconds for kind in ("pub", "ans")]
    found = cache.get_many(keys)
    judged = []
    for s in seconds:
        published = int(found.get(_delivery_key("pub", s), 0))
        if published:
            judged.append((s, published, int(found.get(_delivery_key("ans", s), 0))))
    shares = [min(a, p) / p for _, p, a in judged]
    return DeliveryRate(lowest=min(shares) if shares else None, seconds=judged)


def delivery_forget(*, now: float | None = None) -> None:
    """Drop the tallies of the last DELIVERY_TTL_S (after a deliberate fault, or between
    tests that share one cache)."""
    _pending.flush()
    now = time.time() if now is None else now
    cache.delete_many([_delivery_key(kind, s) for s in range(int(now) - DELIVERY_TTL_S,
                                                             int(now) + 2)
                       for kind in ("pub", "ans")])


# --- counts handed over later -----------------------------------------------------------------
def counters_add_later(counts: Mapping[str, int]) -> None:
    """Add to the shared counters within about a second, together with everything else this
    process counted meanwhile (one round trip per name and second, not per message)."""
    _pending.add(counts=counts)


def metrics_flush() -> None:
    """Hand this process's pending counts over now (tests, and before the process ends)."""
    _pending.flush()


class _Pending:
    """This process's counts not yet in the cache, handed over by a thread of its own, which
    starts on first use (again in a forked child: threads do not survive a fork)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.tallies: Counter = Counter()
        self.thread: threading.Thread | None = None
        self.failed_at = -60.0

    def add(self, *, counts: Mapping[str, int] | None = None,
            tallies: Mapping[str, int] | None = None) -> None:
        if not counts and not tallies:
            return
        with self.lock:
            self.counts.update(counts or {})
            self.tallies.update(tallies or {})
            if self.thread is None:
                # Called after commits: counting must never fail the path that counts.
                try:
                    thread = threading.Thread(target=self._run, name="metrics-flush",
                                              daemon=True)
                    thread.start()
                    self.thread = thread
                except RuntimeError as exc:  # no thread to be had: the next add tries again
                    log.warning("could not start the metrics flusher: %s", exc)

    def _run(self) -> None:
        while True:
            time.sleep(FLUSH_EVERY_S)
            self.flush()

    def flush(self) -> None:
        with self.lock:
            counts, tallies = self.counts, self.tallies
            self.counts, self.tallies = Counter(), Counter()
        if not counts and not tallies:
            return
        try:
            _write_counters(counts)
            for key, value in tallies.items():
                _incr(key, value, timeout=DELIVERY_TTL_S)
        except Exception as exc:
            # The cache (Redis) is down: keep the counters for the next turn. Tallies of
            # seconds gone by are of no use to readiness later, and are dropped.
            with self.lock:
                self.counts.update(counts)
            now = time.monotonic()
            if now - self.failed_at >= 60:
                self.failed_at = now
                log.warning("could not record counters (%s: %s); keeping them for the "
                            "next try", type(exc).__name__, exc)


_pending = _Pending()
os.register_at_fork(after_in_child=_pending._reset)
atexit.register(metrics_flush)
