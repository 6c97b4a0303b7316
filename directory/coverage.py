"""Capability coverage: for every capability an agent offers, how many agents could take
work for it now. A capability with none is an alarm: `capability:x` sends fail
UNDELIVERABLE until one comes back.

Judged by `candidate_for`, the one rule capability routing uses (draining, lapsed, STALE
node, node down, stale agent), so the overview never calls an agent routable that routing
would pass over. How full an agent is (its load) is not coverage: a full agent frees up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.core.cache import cache
from django.utils import timezone

from directory.resolver import AGENT_FIELDS, candidate_for
from roster.models import Agent, Dialect

# Agents named per capability (the rest are counted): enough to act on, small to render.
SHOWN_PER_CAPABILITY = 5
CACHE_KEY = "directory:capability-coverage"


@dataclass
class Coverage:
    capability: str
    routable: int = 0
    total: int = 0
    # (agent id, why it cannot take work), the first few by agent id.
    unroutable: list[tuple[str, str]] = field(default_factory=list)

    @property
    def uncovered(self) -> bool:
        return self.routable == 0


def capability_coverage(*, now: datetime | None = None, reuse_s: int = 0) -> list[Coverage]:
    """Every capability on the roster, the uncovered ones first, then by name. One read of
    the roster's few routing columns (no model instances) over every agent: an OFFLINE
    agent's capability still exists, and is uncovered when no one else offers it.

    `reuse_s`: share the answer through the cache for that long, so pages that refresh from
    the stream (the overview, about every 2 s per open page) read the roster once in that
    time, not once per page and refresh. Without the cache it is read each time."""
    if reuse_s:
        try:
            kept = cache.get(CACHE_KEY)
        except Exception:  # the cache (Redis) is down: read the roster instead
            kept = None
        if kept is not None:
            return kept
    found = _coverage(now or timezone.now())
    if reuse_s:
        try:
            cache.set(CACHE_KEY, found, timeout=reuse_s)
        except Exception:  # noqa: S110 - only the reuse is lost; the answer stands
            pass
    return found


def _coverage(now: datetime) -> list[Coverage]:
    found: dict[str, Coverage] = {}
    # What native sends can reach: an A2A-over-MQTT profile agent's skills are no cover (no
    # native send reaches it), and no alarm of a capability nobody routes to.
    rows = (Agent.objects.filter(dialect=Dialect.NATIVE)
            .values(*AGENT_FIELDS, "capabilities").order_by("agent_id"))
    for row in rows:
        capabilities = row["capabilities"]
        if not isinstance(capabilities, list) or not capabilities:
            continue
        candidate = candidate_for(row, now)
        for capability in {c for c in capabilities if isinstance(c, str) and c}:
            cover = found.setdefault(capability, Coverage(capability))
            cover.total += 1
            if candidate.routable:
                cover.routable += 1
            elif len(cover.unroutable) < SHOWN_PER_CAPABILITY:
                cover.unroutable.append((candidate.agent_id, candidate.why))
    return sorted(found.values(), key=lambda c: (not c.uncovered, c.capability))
