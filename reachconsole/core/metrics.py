"""Counters shared by every process through the cache (Redis in production), read by
`/metrics` in Prometheus text format. Writers add in batches, never per message."""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Mapping

from django.core.cache import cache

log = logging.getLogger(__name__)

PREFIX = "metric:"
INDEX_KEY = "metric-index"
_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


def counters_add(counts: Mapping[str, int]) -> None:
    """Add to counters named `name` or `name:label` (label → `reason="label"`)."""
    if not counts:
        return
    try:
        index = set(cache.get(INDEX_KEY) or ())
        new_names = {name for name in counts if name not in index}
        for name, value in counts.items():
            if not value:
                continue
            key = PREFIX + name
            cache.add(key, 0, timeout=None)
            cache.incr(key, value)
        if new_names:
            cache.set(INDEX_KEY, sorted(index | new_names), timeout=None)
    except Exception:  # counting must never break the path that counts
        log.exception("could not record counters")


def counters_snapshot() -> dict[str, int]:
    names = cache.get(INDEX_KEY) or []
    values = cache.get_many([PREFIX + name for name in names])
    return {name: int(values.get(PREFIX + name, 0)) for name in names}


def prometheus_text(extra: Mapping[str, float] | None = None) -> str:
    grouped: dict[str, list[tuple[str, int]]] = {}
    for name, value in sorted(counters_snapshot().items()):
        base, _, label = name.partition(":")
        metric = f"reach_{base}_total"
        if not _NAME.match(metric):
            continue
        grouped.setdefault(metric, []).append((label, value))
    lines = []
    for metric, series in grouped.items():
        lines.append(f"# TYPE {metric} counter")
        for label, value in series:
            safe = label.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'{metric}{{reason="{safe}"}} {value}' if label else f"{metric} {value}")
    typed = set()
    for name, value in (extra or {}).items():
        base = name.partition("{")[0]
        if base not in typed:
            typed.add(base)
            lines.append(f"# TYPE {base} gauge")
        lines.append(f"{name} {value}")
    return "\n".join(lines) + "\n"


class LocalCounter(Counter):
    """Counts in memory and hands them to the shared counters at most once per flush."""

    def flush(self) -> None:
        counts = dict(self)
        self.clear()
        counters_add(counts)
