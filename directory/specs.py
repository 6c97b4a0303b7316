"""The merged directory view: one entry per capability segment, with the node that serves it.

Remote before local: a capability that a remote node hosts is never resolved to a console
agent that has no consumer for it. The caller's namespace wins a segment, so a stale
`llm.bank-statement` left behind by a namespace switch never captures what now belongs to
`fin.bank-statement`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.utils import timezone

from directory.resolver import Candidate, candidate_for, rank_key
from roster.models import Agent


@dataclass(frozen=True, slots=True)
class SpecEntry:
    segment: str
    agent_id: str
    node_id: str
    namespace: str
    status: str
    routable: bool
    remote: bool
    shadowed: list[Candidate]

    def as_dict(self) -> dict:
        return {"capability": self.segment, "agentId": self.agent_id, "nodeId": self.node_id,
                "namespace": self.namespace, "status": self.status, "routable": self.routable,
                "remote": self.remote, "shadowed": [c.as_dict() for c in self.shadowed]}


def specs(*, namespace: str | None = None, namespaces: frozenset[str] | None = None,
          now: datetime | None = None) -> list[SpecEntry]:
    """`namespaces`: the caller's token is bound to these; agents of others are neither
    entries nor shadowed candidates."""
    now = now or timezone.now()
    by_segment: dict[str, list[Candidate]] = defaultdict(list)
    agents = Agent.objects.select_related("node", "namespace").order_by("agent_id")
    if namespaces is not None:
        agents = agents.filter(namespace__name__in=namespaces)
    for agent in agents:
        by_segment[agent.segment].append(candidate_for(agent, now))
    entries = []
    for segment in sorted(by_segment):
        ranked = sorted(by_segment[segment], key=lambda c: rank_key(c, namespace))
        best = ranked[0]
        entries.append(SpecEntry(
            segment=segment, agent_id=best.agent_id, node_id=best.node_id,
            namespace=best.namespace, status=best.status, routable=best.routable,
            remote=best.node_id != settings.REACH_NODE_ID, shadowed=ranked[1:],
        ))
    return entries
