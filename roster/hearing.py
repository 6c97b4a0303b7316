"""Whether the console hears the bus, and since when (roster.models.BusHearing).

Each bridge reports every second while it is connected and its database writes go through.
A report after a silence longer than HEARING_GAP_S starts a new hearing period, so a
database, Redis or worker outage counts as "not heard" even when the MQTT connection held.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Case, F, Min, Value, When
from django.utils import timezone

from roster.models import BusHearing

# A bridge silent for longer than this is not hearing (it reports every second).
HEARING_GAP_S = 3.0
# The directory asks once per candidate; one answer serves a whole resolve (same `now`).
# One tuple, replaced whole: readers in other threads never see half of it.
_MEMO_S = 0.25
_memo: tuple | None = None
# For a console that runs no bridge at all (REACH_JUDGE_BY_CLOCK): heard "forever".
_ALWAYS = datetime(2000, 1, 1, tzinfo=UTC)


def hearing_record(*, instance: str, now: datetime | None = None) -> None:
    """This bridge heard the bus just now (connected, and its writes commit)."""
    global _memo
    now = now or timezone.now()
    _memo = None
    gap = now - timedelta(seconds=HEARING_GAP_S)
    # One statement: a report after a gap (or after hearing_lost) opens a new period.
    updated = BusHearing.objects.filter(instance=instance).update(
        hearing_since=Case(
            When(hearing_since__isnull=True, then=Value(now)),
            When(heard_at__lt=gap, then=Value(now)),
            default=F("hearing_since"),
        ),
        heard_at=now,
    )
    if not updated:
        with transaction.atomic():
            BusHearing.objects.get_or_create(
                instance=instance, defaults={"hearing_since": now, "heard_at": now})


def hearing_lost(*, instance: str) -> None:
    """This bridge stopped hearing (disconnected or stopping)."""
    global _memo
    _memo = None
    BusHearing.objects.filter(instance=instance).update(hearing_since=None)


def bus_heard_since(*, now: datetime | None = None) -> datetime | None:
    """Since when the console has heard the bus without a gap, or None when no bridge hears
    it now. With several bridges, the longest unbroken period counts."""
    global _memo
    if settings.REACH_JUDGE_BY_CLOCK:
        return _ALWAYS
    now = now or timezone.now()
    memo = _memo
    if memo is not None and memo[0] == now and time.monotonic() - memo[1] < _MEMO_S:
        return memo[2]
    gap = now - timedelta(seconds=HEARING_GAP_S)
    since = (BusHearing.objects.filter(hearing_since__isnull=False, heard_at__gte=gap)
             .aggregate(since=Min("hearing_since"))["since"])
    _memo = (now, time.monotonic(), since)
    return since


def heard_for(*, window: timedelta, now: datetime | None = None) -> bool:
    """Whether the console has heard the bus for at least `window` up to `now`: only then may
    it blame an agent for not being heard within that window."""
    now = now or timezone.now()
    since = bus_heard_since(now=now)
    return since is not None and since <= now - window


def bridges_hearing(*, now: datetime | None = None) -> list[BusHearing]:
    """The bridges that hear the bus now (for readiness and metrics)."""
    now = now or timezone.now()
    gap = now - timedelta(seconds=HEARING_GAP_S)
    return list(BusHearing.objects.filter(hearing_since__isnull=False, heard_at__gte=gap)
                .order_by("instance"))
