"""Whether the console hears the bus, from when and up to when (roster.models.BusHearing).

The one rule for silence, used by leases, staleness, node DOWN and STALE, and receivers that
do not acknowledge: **something is blamed for being silent over a window only if the console
itself has proof that it heard the bus over that whole window.** Anything else (a worker
restart, a database or Redis outage, a broker connection that stalls without closing) is the
console's own deafness, and nobody's fault.

The proof is a probe: each bridge publishes a small message to a topic of its own every
`PROBE_EVERY_S` and takes it back through its subscriptions, in the same queue as everything
else it receives (messages/probes.py; messages/mqtt_session.py sends them and hands them
over, messages/bridge.py takes them). When the owner thread has stored everything that
arrived before a probe, the console has heard the bus up to the moment that probe was sent:
that moment is the bridge's `heard_at` ("through"). An
unbroken chain of probes (numbered, sent on one connection after the broker granted its
subscriptions) is one hearing period (`hearing_since` .. `heard_at`); a missing probe, a
reconnect, a change of what the bridge subscribes to or a restart starts a new one. So an
open socket that carries nothing, or a bridge whose writes do not commit, does not count as
hearing.

Judgments are made at the console's "heard through" time, never at the wall clock: a lease
that ended at 12:00:03 lapses only once the console has proof it heard up to 12:00:03 and the
agent was not heard (`Hearing.cutoff`). The grace after an outage follows from it: every
agent gets the full window, counted from when hearing started again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from roster.models import BusHearing

# How often a bridge sends its probe.
PROBE_EVERY_S = 0.5
# Readiness and the pages: a bridge whose proof is older than this does not hear the bus now
# (its probes lag at most about a second behind on a healthy connection).
HEARING_FRESH_S = 3.0
# The directory asks once per candidate; one answer serves a whole resolve (same `now`).
# One tuple, replaced whole: readers in other threads never see half of it.
_MEMO_S = 0.25
_memo: tuple | None = None
# For a console that runs no bridge at all (REACH_JUDGE_BY_CLOCK): heard "forever".
_ALWAYS = datetime(2000, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Hearing:
    """The console heard the bus without a gap from `since` up to `through`."""

    since: datetime
    through: datetime

    def cutoff(self, window: timedelta) -> datetime | None:
        """What was last heard before this has been silent for `window` of time the console
        heard: `through - window`. None while the console has not heard for `window` (it
        cannot tell anyone's silence from its own deafness)."""
        return self.through - window if self.heard_for(window) else None

    def heard_for(self, window: timedelta) -> bool:
        return self.since <= self.through - window

    def through_once_heard_for(self, window: timedelta) -> datetime | None:
        """Up to when anything may be judged, once the console has heard for `window`
        (a lease TTL, an ACK timeout): `through`, else None."""
        return self.through if self.heard_for(window) else None


def hearing_record(*, instance: str, since: datetime, through: datetime) -> None:
    """This bridge has heard the bus without a gap from `since` up to `through` (the moment
    its latest probe back was sent). The bridge keeps the chain; this stores it."""
    global _memo
    _memo = None
    updated = BusHearing.objects.filter(instance=instance).update(
        hearing_since=since, heard_at=through)
    if not updated:
        with transaction.atomic():
            BusHearing.objects.update_or_create(
                instance=instance, defaults={"hearing_since": since, "heard_at": through})


def hearing_lost(*, instance: str) -> None:
    """This bridge stopped hearing (disconnected, stalled or stopping)."""
    global _memo
    _memo = None
    BusHearing.objects.filter(instance=instance).update(hearing_since=None)


def periods_join(periods: list[tuple[datetime, datetime]]) -> tuple[datetime, datetime] | None:
    """The unbroken stretch, out of several bridges' periods, that reaches the latest proof:
    two bridges that overlap are one stretch of hearing; a bridge whose proof ends before the
    stretch begins does not lengthen it (the time between was heard by nobody)."""
    if not periods:
        return None
    periods = sorted(periods, key=lambda p: p[1], reverse=True)
    since, through = periods[0]
    for start, end in periods[1:]:
        if end >= since:
            since = min(since, start)
    return since, through


def bus_hearing(*, now: datetime | None = None) -> Hearing | None:
    """The console's hearing up to `now`, or None when it has never heard (or no bridge
    hears at all). `through` is never later than `now`."""
    global _memo
    now = now or timezone.now()
    if settings.REACH_JUDGE_BY_CLOCK:
        return Hearing(since=_ALWAYS, through=now)
    memo = _memo
    if memo is not None and memo[0] == now and time.monotonic() - memo[1] < _MEMO_S:
        return memo[2]
    rows = BusHearing.objects.filter(hearing_since__isnull=False, heard_at__isnull=False)
    joined = periods_join(list(rows.values_list("hearing_since", "heard_at")))
    hearing = None
    if joined is not None and joined[0] <= now:
        hearing = Hearing(since=joined[0], through=min(joined[1], now))
    _memo = (now, time.monotonic(), hearing)
    return hearing


def bridges_hearing(*, now: datetime | None = None) -> list[BusHearing]:
    """The bridges that hear the bus now (for readiness and metrics)."""
    now = now or timezone.now()
    fresh = now - timedelta(seconds=HEARING_FRESH_S)
    return list(BusHearing.objects.filter(hearing_since__isnull=False, heard_at__gte=fresh)
                .order_by("instance"))


def bridges_gone_quiet(*, now: datetime | None = None) -> list[BusHearing]:
    """Bridges that were hearing a moment ago and whose probe has stopped coming back: a
    connection that stalled without closing, or an owner thread stuck on the database. A
    live bridge calls such a connection dead after MQTT_KEEPALIVE_S; one quiet for longer
    has stopped without saying so (a killed worker) and is not listed."""
    now = now or timezone.now()
    fresh = now - timedelta(seconds=HEARING_FRESH_S)
    recent = fresh - timedelta(seconds=settings.MQTT_KEEPALIVE_S + 2)
    return list(BusHearing.objects.filter(hearing_since__isnull=False, heard_at__lt=fresh,
                                          heard_at__gte=recent).order_by("instance"))


# --- a node's silence: the rule the sweeps, the pages and the directory share ---------------
DOWN_AFTER_HEARTBEATS = 3


def node_down_after(heartbeat_ms: int | None) -> timedelta:
    """How long a node may be silent before it is DOWN: three of its heartbeat intervals (as
    its heartbeats announce them, else REACH_HEARTBEAT_MS)."""
    return timedelta(milliseconds=DOWN_AFTER_HEARTBEATS
                     * (heartbeat_ms or settings.REACH_HEARTBEAT_MS))


def silence_words(node_id: str, last_seen: datetime, *, now: datetime,
                  window: timedelta) -> str:
    """Why a silent node is DOWN and STALE, as the node's card and the directory say it.
    `now`: up to when the console heard the bus (`bus_hearing`, above)."""
    silent = int((now - last_seen).total_seconds())
    return (f"node {node_id} has been silent for {silent} s (more than "
            f"{int(window.total_seconds())} s, three heartbeats)")
