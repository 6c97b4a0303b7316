"""The load of an agent as the console routes by it, for the roster's pages and API.

Two sources, one definition. The node reports in each heartbeat what the agent is executing
(`Agent.inflight`, after it acknowledged the task) and its queue depth. What the console has
sent the agent and not yet seen answered (in flight) or keeps back behind its maxInflight
(held) is counted by the messages app (messages/backpressure.py, the table `a2a_agent_load`). The
roster does not import that app (the layers in pyproject.toml): the messages app registers
its reader here when it starts (messages/apps.py). Capability routing adds the same three
numbers (directory/routing.py), so the load shown is the load the directory chooses by.

Heartbeats are sampled between tasks, so a node that works one task at a time reports 0 for
`executing` almost always: that alone is why a Load column of heartbeat numbers stayed 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

KeptCounts = Callable[[Iterable[str]], dict[str, tuple[int, int]]]
_kept: KeptCounts | None = None


def kept_counts_register(reader: KeptCounts) -> None:
    """Called once by the messages app at start-up."""
    global _kept
    _kept = reader


@dataclass(frozen=True, slots=True)
class LoadFigures:
    inflight: int  # sent by the console, not yet answered (ACK, NACK, BUSY)
    held: int  # kept back by the console behind maxInflight
    executing: int  # acknowledged and running, as the node last reported
    queue_depth: int  # the node's own queue, as it last reported
    max_inflight: int

    @property
    def total(self) -> int:
        return self.inflight + self.held + self.executing

    @property
    def ratio(self) -> float:
        """What capability routing compares: in flight + held + executing over maxInflight."""
        return self.total / max(1, self.max_inflight)

    @property
    def percent(self) -> int:
        return round(self.ratio * 100)


def agents_load(agents: Iterable) -> dict[str, LoadFigures]:
    """The load of each of these agents (roster Agent rows), one query for all of them."""
    agents = list(agents)
    kept = _kept([a.agent_id for a in agents]) if _kept and agents else {}
    return {a.agent_id: LoadFigures(inflight=kept.get(a.agent_id, (0, 0))[0],
                                  held=kept.get(a.agent_id, (0, 0))[1],
                                  executing=a.inflight, queue_depth=a.queue_depth,
                                  max_inflight=a.max_inflight) for a in agents}


LOAD_MEANING = (
    "in flight: task requests the console has sent to the agent and not yet seen answered "
    "(ACK, NACK or BUSY); held: kept back by the console until a slot frees (maxInflight); "
    "executing: acknowledged and running, as its node last reported. Load is their sum over "
    "maxInflight, the figure capability routing compares"
)
