"""Capability routing and group expansion: which live agents may take a piece of work.

Capability: among ONLINE, non-stale, non-draining agents with the capability in the caller's
namespace (others only when their namespace is open), the least loaded — by the load its last
heartbeat reported plus what the console has sent it and not seen acknowledged — with the
caller's region preferred on a tie and remaining ties spread round-robin.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime

from django.db.models import Q
from django.utils import timezone

from directory.resolver import Candidate, Resolution, candidate_for
from roster.ids import profile_agent_id, profile_pool_id
from roster.models import Agent, Namespace

UnackedCounts = Callable[[list[str]], Mapping[str, int]]
MAX_ROUTE_CANDIDATES = 500

_turns: dict[str, itertools.count] = {}
_turns_lock = threading.Lock()


def _next_turn(key: str) -> int:
    with _turns_lock:
        counter = _turns.setdefault(key, itertools.count())
        return next(counter)


def namespace_of(agent_id: str | None) -> str | None:
    if agent_id and (profile_agent_id(agent_id) or profile_pool_id(agent_id)):
        # The A2A-over-MQTT profile's agents and pools: their org.
        return agent_id.split("/", 1)[0]
    if not agent_id or "." not in agent_id:
        return None
    return agent_id.split(".", 1)[0]


def _namespace_q(namespace: str | None, within: Iterable[str] | None = None) -> Q:
    """The agents a caller of `namespace` may reach: its own namespace and the open ones,
    and never outside `within` (the namespaces a bound service token may reach)."""
    q = Q() if namespace is None else (
        Q(namespace__name=namespace) | Q(namespace__open_to_other_namespaces=True))
    if within is not None:
        q &= Q(namespace__name__in=sorted(within))
    return q


def caller_region(from_agent_id: str | None) -> str | None:
    if not from_agent_id:
        return None
    metadata = Agent.objects.filter(agent_id=from_agent_id).values_list("metadata", flat=True)
    first = metadata.first()
    region = first.get("region") if isinstance(first, dict) else None
    return region if isinstance(region, str) else None


def route_capability(*, capability: str, from_agent_id: str | None = None,
                     exclude: Iterable[str] = (), unacked: UnackedCounts | None = None,
                     within: Iterable[str] | None = None,
                     now: datetime | None = None, preview: bool = False) -> Resolution:
    """`preview`: what routing would do, for a page; it takes no round-robin turn, so
    looking never changes which agent the next real send goes to."""
    now = now or timezone.now()
    namespace = namespace_of(from_agent_id)
    excluded = set(exclude)
    agents = list(
        Agent.objects.select_related("node", "namespace")
        .filter(_namespace_q(namespace, within), capabilities__icontains=json.dumps(capability))
        .order_by("agent_id")[:MAX_ROUTE_CANDIDATES]
    )
    # icontains on the JSON text can match inside a longer name in odd cases: check exactly.
    agents = [a for a in agents if capability in a.capabilities]
    if not agents:
        scope = f"namespace {namespace} or an open namespace" if namespace else "any namespace"
        if within is not None:
            scope += f" that this caller may reach ({', '.join(sorted(within)) or 'none'})"
        return Resolution(None, None, "capability",
                          f"no agent in {scope} offers capability {capability}",
                          outcome="not_found")
    counts = unacked([a.agent_id for a in agents]) if unacked else {}
    region = caller_region(from_agent_id)
    candidates: list[Candidate] = []
    for agent in agents:
        c = candidate_for(agent, now)
        load = (agent.inflight + counts.get(agent.agent_id, 0)) / max(1, agent.max_inflight)
        if c.agent_id in excluded:
            c = Candidate(c.agent_id, c.node_id, c.status, False, "already tried for this task",
                          c.namespace, load)
        elif c.routable and load >= 1.0:
            c = Candidate(c.agent_id, c.node_id, c.status, False,
                          f"full: {load:.0%} of maxInflight in use", c.namespace, load)
        else:
            c = Candidate(c.agent_id, c.node_id, c.status, c.routable, c.why, c.namespace, load)
        candidates.append(c)
    region_of = {a.agent_id: (a.metadata or {}).get("region") for a in agents}

    def rank(c: Candidate) -> tuple:
        return (not c.routable, c.load, region is None or region_of.get(c.agent_id) != region)

    candidates.sort(key=lambda c: (*rank(c), c.agent_id))
    live = [c for c in candidates if c.routable]
    if not live:
        return Resolution(None, None, "capability",
                          f"capability {capability}: no live agent can take work now",
                          candidates, outcome="not_deliverable", match="capability")
    tied = [c for c in live if rank(c) == rank(live[0])]
    best = tied[0 if preview else _next_turn(f"cap:{capability}") % len(tied)]
    why = "least loaded" + (f", round-robin among {len(tied)}" if len(tied) > 1 else "")
    chosen = Candidate(best.agent_id, best.node_id, best.status, True, why, best.namespace,
                       best.load, chosen=True)
    ordered = [chosen] + [c for c in candidates if c.agent_id != best.agent_id]
    return Resolution(best.agent_id, best.node_id, "capability",
                      f"capability {capability} → {best.agent_id}", ordered, match="capability")


def group_members(*, group: str, from_agent_id: str | None = None,
                  within: Iterable[str] | None = None,
                  now: datetime | None = None) -> list[Candidate]:
    """Every member of `#group` the caller may reach, routable or not (with why)."""
    now = now or timezone.now()
    label = group if group.startswith("#") else f"#{group}"
    agents = (
        Agent.objects.select_related("node", "namespace")
        .filter(_namespace_q(namespace_of(from_agent_id), within),
                groups__icontains=json.dumps(label))
        .order_by("agent_id")
    )
    return [candidate_for(a, now) for a in agents if label in a.groups]


def isolation_refusal(*, from_agent_id: str | None, to_agent_id: str) -> str | None:
    """Words for a cross-namespace send that the target's namespace does not allow."""
    source, target = namespace_of(from_agent_id), namespace_of(to_agent_id)
    if source is None or target is None or source == target:
        return None
    if Namespace.objects.filter(name=target, open_to_other_namespaces=True).exists():
        return None
    return (f"{from_agent_id} (namespace {source}) may not send to {to_agent_id}: namespace "
            f"{target} is not open to other namespaces (a flag an operator sets in the admin)")
