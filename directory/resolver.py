"""Turns an addressee into one agent on one node, or says why not and what it considered.

The only place that resolves addresses (ARCHITECTURE.md). Explicit beats implicit: an
explicit node is never swapped for another, and a name the roster cannot place on a live node
is a miss with its candidates, never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.utils import timezone

from roster.models import Agent

LOCAL_AGENTS = ("ops.probe",)  # handled inside the console, on REACH_NODE_ID


@dataclass(frozen=True, slots=True)
class Candidate:
    agent_id: str
    node_id: str
    status: str
    routable: bool
    why: str

    def as_dict(self) -> dict:
        return {"agentId": self.agent_id, "nodeId": self.node_id, "status": self.status,
                "routable": self.routable, "why": self.why}


@dataclass(frozen=True, slots=True)
class Resolution:
    agent_id: str | None
    node_id: str | None
    level: str | None
    reason: str
    candidates: list[Candidate] = field(default_factory=list)
    local: bool = False

    @property
    def ok(self) -> bool:
        return self.node_id is not None


def _candidate(agent: Agent, now: datetime) -> Candidate:
    if agent.status == Agent.Status.DRAINING:
        return Candidate(agent.agent_id, agent.node.node_id, agent.status, False,
                         "draining: it takes no new work")
    if agent.status == Agent.Status.OFFLINE or agent.lease_expires_at <= now:
        return Candidate(agent.agent_id, agent.node.node_id, "OFFLINE", False,
                         "its lease has lapsed")
    return Candidate(agent.agent_id, agent.node.node_id, agent.status, True, "live")


def is_local_agent(agent_id: str) -> bool:
    return agent_id in LOCAL_AGENTS


def resolve_agent_node(
    *, to_agent_id: str, target_node_id: str | None = None, now: datetime | None = None
) -> Resolution:
    """The node that receives work for `to_agent_id`: the explicit node first, else the
    roster's node for the agent; nothing else."""
    now = now or timezone.now()
    local_node = settings.REACH_NODE_ID
    if is_local_agent(to_agent_id) and target_node_id in (None, "", local_node):
        return Resolution(to_agent_id, local_node, "local", "handled by the console", local=True)

    agent = Agent.objects.select_related("node").filter(agent_id=to_agent_id).first()
    if agent is None:
        return Resolution(
            None, None, None,
            f"no agent {to_agent_id} is on the roster; check the id or register the agent",
        )
    candidate = _candidate(agent, now)
    if target_node_id:
        if agent.node.node_id != target_node_id:
            return Resolution(
                None, None, "explicit",
                f"node {target_node_id} does not host {to_agent_id}; the roster places it on "
                f"{agent.node.node_id}. An explicit node is never swapped for another: send "
                f"to {agent.node.node_id} or without targetNodeId",
                [candidate],
            )
        level = "explicit"
    else:
        level = "roster"
    if not candidate.routable:
        return Resolution(
            None, None, level, f"{to_agent_id} on {agent.node.node_id} is {candidate.why}",
            [candidate],
        )
    return Resolution(agent.agent_id, agent.node.node_id, level, "live", [candidate])
