"""The roster page's numbers: each agent's success rate, p95 sent → answered and tasks over
the last 15 minutes, and the roster sorted by them (?sort=success, -success, p95, -p95,
tasks, -tasks).

Why here, in the composition root, handed to roster's view by reachconsole/urls.py: the
numbers are the messages app's and the page is the roster's, and roster imports neither app
(ARCHITECTURE.md; import-linter's "layers" contract). Cells alone could come from a messages
partial beside each row, but a sort must order the whole filtered roster before a page is
cut from it, so the order has to be decided where both the numbers and the roster can be
read: here, which may import both, as reachconsole/overview.py does.

What it costs, at 10,000 agents as at ten: one read of the numbers per page (subjects_stats,
a grouped read of the window's rollup buckets), never one per agent. Unsorted, it is read for
the page's agents only. Sorted by a number, it is read for every agent with traffic in the
window, and the roster's filtered ids are read once (one column), so the order is exact
across the whole roster, not just the shown page; the page's rows are then read by id.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from datetime import datetime

from messages.ledger import AGENT
from messages.rollups import WINDOWS, SubjectStats, subjects_stats
from roster.selectors import AgentFilter, AgentPage, agents_filter

WINDOW = "15m"
# A sort's first click puts the agents an operator looks for first: the lowest success, the
# slowest answers, the busiest. The other direction is the same name with or without "-".
FIRST_DIRECTION = {"success": "success", "p95": "-p95", "tasks": "-tasks"}
SORTS = {
    "success": "by success rate, lowest first", "-success": "by success rate, highest first",
    "p95": "by p95 answer time, fastest first", "-p95": "by p95 answer time, slowest first",
    "tasks": "by tasks, fewest first", "-tasks": "by tasks, most first",
}
# A sorted page's cursor: "s|<section>|<value>|<agent id>" (section 0: has the number in the
# window, 1: has none), so it never reads as the default order's "fine|agent id".
CURSOR_PREFIX = "s"


@dataclass(frozen=True, slots=True)
class AgentNumbers:
    tasks: int
    completed: int
    finished: int
    success_rate: float | None
    p95_answer_s: float | None  # approximate: from a histogram (messages/rollups.py)

    @property
    def success_text(self) -> str:
        return "—" if self.success_rate is None else f"{self.success_rate * 100:.1f} %"

    @property
    def p95_text(self) -> str:
        s = self.p95_answer_s
        if s is None:
            return "—"
        return f"≈ {s * 1000:.3g} ms" if s < 1 else f"≈ {s:.3g} s"

    def value(self, key: str) -> float | None:
        """The number a sort orders by; None sorts the agent after those that have one."""
        if key == "success":
            return self.success_rate
        if key == "p95":
            return self.p95_answer_s
        return float(self.tasks) if self.tasks else None


def _numbers(stats: SubjectStats) -> AgentNumbers:
    return AgentNumbers(tasks=max(0, stats.counts.get("tasks", 0)), completed=stats.completed,
                        finished=stats.finished, success_rate=stats.success_rate,
                        p95_answer_s=stats.answer(0.95))


def _cursor_read(after: str) -> tuple[int, float, str] | None:
    prefix, _, rest = after.partition("|")
    section, _, rest = rest.partition("|")
    value, _, agent_id = rest.partition("|")
    if prefix != CURSOR_PREFIX or section not in ("0", "1") or not agent_id:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return (int(section), number, agent_id) if math.isfinite(number) else None


class RosterNumbers:
    """What roster.views.health asks for (its RosterNumbers protocol)."""

    window = WINDOW
    window_label = "15 m"
    window_minutes = WINDOWS[WINDOW][0] // 60
    sorts = SORTS
    first_direction = FIRST_DIRECTION

    def allowed(self, user) -> bool:
        # Numbers about messages are read with the messages' view permission (a viewer has
        # it); the roster page itself needs none.
        return user.has_perm("a2a.view_message")

    def cells(self, agent_ids: list[str], *, now: datetime) -> dict[str, AgentNumbers]:
        if not agent_ids:
            return {}
        found = subjects_stats(scope=AGENT, window=WINDOW, subjects=agent_ids, now=now)
        return {agent_id: _numbers(stats) for agent_id, stats in found.items()}

    def agents_page(self, flt: AgentFilter, *, sort: str, after: str, size: int,
                    now: datetime) -> tuple[AgentPage, dict[str, AgentNumbers]]:
        """One page of the filtered roster in the order of a number: the agents that have it
        in the window by it (ties by agent id), then those without traffic, by agent id.
        Keyset paging on (section, number, agent id), as roster.selectors.agents_page pages
        on (fine, agent id): no OFFSET. The numbers move with the traffic, so an agent whose
        number changed between two pages may show on both or on neither, as in any list
        ordered by a live value."""
        key, descending = sort.lstrip("-"), sort.startswith("-")
        numbers = {agent_id: _numbers(stats) for agent_id, stats in
                   subjects_stats(scope=AGENT, window=WINDOW, now=now).items()}

        def place(agent_id: str) -> tuple[int, float, str]:
            found = numbers.get(agent_id)
            value = found.value(key) if found else None
            if value is None:
                return (1, 0.0, agent_id)
            return (0, -value if descending else value, agent_id)

        ordered = sorted(place(agent_id) for agent_id in
                         agents_filter(flt, now=now).values_list("agent_id", flat=True))
        cursor = _cursor_read(after)
        start = bisect.bisect_right(ordered, cursor) if cursor else 0
        shown = ordered[start:start + size + 1]
        more = len(shown) > size
        shown = shown[:size]
        ids = [agent_id for _, _, agent_id in shown]
        rows = {a.agent_id: a for a in agents_filter(flt, now=now).filter(agent_id__in=ids)}
        # An agent deregistered between the two reads is left out rather than shown empty.
        agents = [rows[agent_id] for agent_id in ids if agent_id in rows]
        next_cursor = ""
        if more and shown:
            section, value, agent_id = shown[-1]
            next_cursor = f"{CURSOR_PREFIX}|{section}|{value!r}|{agent_id}"
        return (AgentPage(agents, next_cursor),
                {agent_id: numbers[agent_id] for agent_id in ids if agent_id in numbers})


ROSTER_NUMBERS = RosterNumbers()
