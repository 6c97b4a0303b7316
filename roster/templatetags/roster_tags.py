from __future__ import annotations

from datetime import datetime

from django import template

from roster.hearing import bus_hearing

register = template.Library()


@register.filter
def seconds_until(moment: datetime | None, now: datetime) -> str:
    """`12 s`, or `lapsed 3 s ago`: what an operator reads at a glance in a lease column."""
    if moment is None:
        return "—"
    delta = int((moment - now).total_seconds())
    return f"{delta} s" if delta >= 0 else f"lapsed {-delta} s ago"


@register.filter
def seconds_since(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "never"
    return f"{max(0, int((now - moment).total_seconds()))} s ago"


@register.simple_tag
def is_stale(agent, now: datetime) -> bool:
    return agent.is_stale(hearing=bus_hearing(now=now))
