"""Reads of the alarm table shared by the page, the API, the overview, the header and
/metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Count, Q, QuerySet

from alarms.models import Alarm


def unacknowledged_ids(*, limit: int) -> list[int]:
    """Active alarms nobody acknowledged, newest first, at most `limit` (the partial index of
    active alarms serves it)."""
    return list(Alarm.objects.filter(cleared_at__isnull=True, acknowledged_at__isnull=True)
                .order_by("-fired_at", "-id").values_list("id", flat=True)[:limit])


def alarms_list(*, state: str = "active") -> QuerySet[Alarm]:
    """`active`: the alarms whose condition holds; `all`: those and the history. Newest
    first."""
    qs = Alarm.objects.all()
    if state == "active":
        qs = qs.filter(cleared_at__isnull=True)
    return qs.order_by("-fired_at", "-id")


@dataclass
class AlarmTree:
    """An active root alarm and the active alarms it caused."""

    alarm: Alarm
    children: list[Alarm] = field(default_factory=list)


def active_tree() -> list[AlarmTree]:
    """The active alarms, roots newest first (critical before warning), each with its
    children. A child whose parent is no longer active (it cleared in between) stands as a
    root of its own."""
    active = list(Alarm.objects.filter(cleared_at__isnull=True).order_by("-fired_at", "-id"))
    by_id = {a.id: a for a in active}
    trees: dict[int, AlarmTree] = {}
    for alarm in active:
        if alarm.parent_id is None or alarm.parent_id not in by_id:
            trees[alarm.id] = AlarmTree(alarm)
    for alarm in active:
        if alarm.id not in trees:
            trees[alarm.parent_id].children.append(alarm)
    return sorted(trees.values(),
                  key=lambda t: (t.alarm.severity != Alarm.Severity.CRITICAL,
                                 -t.alarm.fired_at.timestamp(), -t.alarm.id))


def history_page(*, older_than: tuple[datetime, int] | None, size: int) -> tuple[list[Alarm],
                                                                                 bool]:
    """Cleared alarms, newest first (by when they fired), keyset paged on the history index:
    the rows before `older_than` (fired_at, id). Returns the page and whether more follow."""
    qs = Alarm.objects.filter(cleared_at__isnull=False).order_by("-fired_at", "-id")
    if older_than is not None:
        at, pk = older_than
        qs = qs.filter(Q(fired_at__lt=at) | Q(fired_at=at, id__lt=pk))
    rows = list(qs.select_related("parent")[:size + 1])
    return rows[:size], len(rows) > size


def active_by_kind() -> dict[str, int]:
    """Active alarms per kind, every kind present (0 when none): /metrics."""
    counts = dict.fromkeys(Alarm.Kind.values, 0)
    counts.update(Alarm.objects.filter(cleared_at__isnull=True).order_by()
                  .values_list("kind").annotate(n=Count("id")))
    return counts
