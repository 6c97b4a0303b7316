"""Turns an addressee into one agent on one node, or says why not and what it considered.

The only place that resolves addresses (ARCHITECTURE.md). The order is the contract:

1. explicit node: with `target_node_id` only agents on that node are considered; no match is
   a miss, never a silent fall-back to another node;
2. mention (`@资金日报`, `fin.tax`, `tax`): exact agent id → alias → capability segment →
   substring;
3. pid: process instance → definition → agent (database, then REACH_PID_LOOKUP_URL);
4. scene id: scene binding → agent.

Ties are broken deterministically (routable, the caller's namespace, remote before the
console's own, least loaded, agent id) and every tied candidate is shown. "Not found" and
"found but not deliverable" are different outcomes with different words.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from django.conf import settings
from django.db import connection
from django.db.models import Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from directory.models import (
    ProcessDefinitionBinding,
    ProcessInstance,
    SceneBinding,
    alias_normalize,
)
from roster.generation import roster_generation
from roster.hearing import bus_hearing
from roster.models import (
    CONSOLE_AGENTS,
    Agent,
    ClusterNode,
    Consistency,
    Dialect,
    lapse_cutoff,
    stale_cutoff,
)

log = logging.getLogger(__name__)

LOCAL_AGENTS = tuple(sorted(CONSOLE_AGENTS))  # handled inside the console, on REACH_NODE_ID
MAX_CANDIDATES = 50

NOT_FOUND = "not_found"
NOT_DELIVERABLE = "not_deliverable"


@dataclass(frozen=True, slots=True)
class Candidate:
    agent_id: str
    node_id: str
    status: str
    routable: bool
    why: str
    namespace: str = ""
    load: float = 0.0
    chosen: bool = False

    def as_dict(self) -> dict:
        return {"agentId": self.agent_id, "nodeId": self.node_id, "status": self.status,
                "routable": self.routable, "why": self.why, "namespace": self.namespace,
                "load": round(self.load, 3), "chosen": self.chosen}


@dataclass(frozen=True, slots=True)
class Resolution:
    agent_id: str | None
    node_id: str | None
    level: str | None
    reason: str
    candidates: list[Candidate] = field(default_factory=list)
    local: bool = False
    match: str | None = None  # how a mention matched: agent_id, alias, capability, substring
    outcome: str = ""  # "" when resolved, else NOT_FOUND or NOT_DELIVERABLE

    @property
    def ok(self) -> bool:
        return self.node_id is not None

    def as_dict(self) -> dict:
        return {"agentId": self.agent_id, "nodeId": self.node_id, "level": self.level,
                "match": self.match, "reason": self.reason, "outcome": self.outcome or None,
                "candidates": [c.as_dict() for c in self.candidates]}


def is_local_agent(agent_id: str) -> bool:
    return agent_id in LOCAL_AGENTS


AGENT_FIELDS = ("agent_id", "segment", "status", "lease_expires_at", "last_heartbeat_at",
                "registered_at", "inflight", "max_inflight", "node__node_id", "namespace__name",
                "node__status", "node__consistency", "node__consistency_reason", "dialect")


def agent_row(agent: Agent) -> dict:
    """The fields the directory judges an agent by, from a model instance."""
    return {"agent_id": agent.agent_id, "segment": agent.segment, "status": agent.status,
            "lease_expires_at": agent.lease_expires_at,
            "last_heartbeat_at": agent.last_heartbeat_at, "registered_at": agent.registered_at,
            "inflight": agent.inflight, "max_inflight": agent.max_inflight,
            "node__node_id": agent.node.node_id, "namespace__name": agent.namespace.name,
            "node__status": agent.node.status, "node__consistency": agent.node.consistency,
            "node__consistency_reason": agent.node.consistency_reason,
            "dialect": agent.dialect}


def candidate_for(agent: Agent | dict, now: datetime, *, accepted: bool = False) -> Candidate:
    """Whether this agent can take new work now, and why not.

    `accepted`: the work was already accepted for this agent (held behind its maxInflight,
    or a retry of an attempt sent to it). A drain stops new work only, so a DRAINING agent
    still takes that while the rest holds (lease, node); the drain's promise that accepted
    work finishes on it is kept here, in the one place that judges agents."""
    row = agent_row(agent) if isinstance(agent, Agent) else agent
    load = row["inflight"] / row["max_inflight"] if row["max_inflight"] else 1.0
    common = {"namespace": row["namespace__name"], "load": load}
    agent_id, node_id, status = row["agent_id"], row["node__node_id"], row["status"]
    if row["dialect"] != Dialect.NATIVE:
        # An agent of the A2A-over-MQTT profile (messages/profile_send.py sends to it): no
        # lease and no heartbeat; its presence is what its retained card last said.
        if not settings.REACH_A2A_PROFILE:
            return Candidate(agent_id, node_id, status, False,
                             "speaks the A2A-over-MQTT profile, which this console does not "
                             "speak now (REACH_A2A_PROFILE=0): nothing would hear its replies",
                             **common)
        if status == Agent.Status.OFFLINE:
            return Candidate(agent_id, node_id, status, False,
                             "offline: its Agent Card says a2a-status=offline (the broker's "
                             "word: its Last Will, or its goodbye)", **common)
        if status == Agent.Status.DRAINING and not accepted:
            return Candidate(agent_id, node_id, status, False, "draining: it takes no new "
                             "work", **common)
        return Candidate(agent_id, node_id, status, True,
                         "live: its Agent Card is on the bus (A2A-over-MQTT)", **common)
    if status == Agent.Status.DRAINING and not accepted:
        return Candidate(agent_id, node_id, status, False, "draining: it takes no new work",
                         **common)
    hearing = bus_hearing(now=now)
    lapsed = lapse_cutoff(hearing)
    if status == Agent.Status.OFFLINE or (lapsed and row["lease_expires_at"] <= lapsed):
        return Candidate(agent_id, node_id, "OFFLINE", False, "its lease has lapsed", **common)
    if row["node__consistency"] == Consistency.STALE:
        # Reconciliation (roster/reconcile.py) found its node gone from the cluster.
        return Candidate(agent_id, node_id, "STALE", False,
                         f"its node is STALE: {row['node__consistency_reason']}", **common)
    if row["node__status"] == ClusterNode.Status.DOWN:
        return Candidate(agent_id, node_id, status, False,
                         f"node {node_id} is down: silent for three heartbeat intervals",
                         **common)
    if node_id == settings.REACH_NODE_ID and not is_local_agent(agent_id):
        # Registered on the console's own node, which runs no consumer for it: work sent
        # there would sit unread. A remote agent with the capability is the right answer.
        return Candidate(agent_id, node_id, status, False,
                         "on the console's own node, which has no consumer for it", **common)
    seen = row["last_heartbeat_at"] or row["registered_at"]
    stale = stale_cutoff(hearing)
    if stale and seen < stale:
        return Candidate(agent_id, node_id, "STALE", False,
                         # heard silence: the console's own deafness is not counted
                         f"stale: no heartbeat for "
                         f"{int((hearing.through - seen).total_seconds())} s",
                         **common)
    if status == Agent.Status.DRAINING:
        return Candidate(agent_id, node_id, status, True,
                         "draining, but this work was accepted for it before the drain",
                         **common)
    return Candidate(agent_id, node_id, status, True, "live", **common)


def rank_key(candidate: Candidate, namespace: str | None) -> tuple:
    """Routable first, then the caller's namespace, then remote before the console's own,
    then the least loaded, then the id: the same order everywhere, so ties never flap."""
    remote = candidate.node_id != settings.REACH_NODE_ID
    return (not candidate.routable, candidate.namespace != (namespace or candidate.namespace),
            not remote, candidate.load, candidate.agent_id)


def _agents(q: Q, namespaces: frozenset[str] | None = None) -> list[dict]:
    # values(): the directory reads a few columns of many rows; no model instances needed.
    if namespaces is not None:
        q &= Q(namespace__name__in=namespaces)
    return list(Agent.objects.filter(q).values(*AGENT_FIELDS)[:MAX_CANDIDATES])


def _within(agent_id: str, namespaces: frozenset[str] | None) -> bool:
    """Whether a token bound to `namespaces` (None: to none) may see this agent id."""
    if namespaces is None:
        return True
    return agent_id.split("/" if agent_id.count("/") == 2 else ".", 1)[0] in namespaces


def _choose(agents: list[dict], *, level: str, match: str | None, namespace: str | None,
            target_node_id: str | None, now: datetime, what: str) -> Resolution:
    """Pick the best of the agents a level matched, or explain why none can take work."""
    candidates = sorted((candidate_for(a, now) for a in agents),
                        key=lambda c: rank_key(c, namespace))
    if target_node_id:
        # Explicit node: agents elsewhere are shown, never chosen.
        candidates = [c if c.node_id == target_node_id else Candidate(
            c.agent_id, c.node_id, c.status, False,
            f"on {c.node_id}, not the explicit node {target_node_id}", c.namespace, c.load)
            for c in candidates]
        candidates.sort(key=lambda c: rank_key(c, namespace))
    best = candidates[0]
    if not best.routable:
        on_node = [c for c in candidates if c.node_id == target_node_id] if target_node_id else []
        if target_node_id and not on_node:
            reason = (f"{what} matched no agent on node {target_node_id}; an explicit node is "
                      "never swapped for another")
            outcome = NOT_FOUND
        else:
            reason = f"{what} matched, but no match can take work now ({best.why})"
            outcome = NOT_DELIVERABLE
        return Resolution(None, None, level, reason, candidates, match=match, outcome=outcome)
    best_rank = rank_key(best, namespace)[:3]
    tied = [c for c in candidates if c.routable and rank_key(c, namespace)[:3] == best_rank]
    chosen = Candidate(best.agent_id, best.node_id, best.status, True,
                       "chosen" + (f" (tie of {len(tied)}: least loaded, then by id)"
                                   if len(tied) > 1 else ""),
                       best.namespace, best.load, chosen=True)
    return Resolution(best.agent_id, best.node_id, level, f"{what} → {best.agent_id}",
                      [chosen, *candidates[1:]], match=match)


_ROW_SQL = (
    "SELECT {level}, a.agent_id, a.segment, a.status, a.lease_expires_at, "
    "a.last_heartbeat_at, a.registered_at, a.inflight, a.max_inflight, n.node_id, ns.name, "
    "n.status, n.consistency, n.consistency_reason, a.dialect "
    "FROM roster_agent a JOIN roster_clusternode n ON n.id = a.node_id "
    "JOIN roster_namespace ns ON ns.id = a.namespace_id WHERE {where}"
)


@functools.lru_cache(maxsize=16)
def _mention_sql(bound_to: int) -> str:
    """The first three levels of a mention in one round trip. Hand-written because it is the
    directory's hot path: the ORM spends longer compiling these queries than the database
    spends running them (bench/resolve.py).

    `bound_to`: the number of namespaces the caller's token is bound to (0: unbound). Their
    agents alone are read, and aliases only when they point into them, so a bound caller's
    answer, candidates and words never name another namespace's agent."""
    in_namespaces = in_targets = ""
    if bound_to:
        in_namespaces = f" AND ns.name IN ({', '.join(['%s'] * bound_to)})"
        in_targets = " AND (" + " OR ".join(["agent_id LIKE %s ESCAPE '!'"] * bound_to) + ")"
    by_alias = "a.agent_id IN (SELECT agent_id FROM directory_alias WHERE alias = %s)"
    return " UNION ALL ".join([  # noqa: S608 - fixed text; values are parameters
        _ROW_SQL.format(level=1, where=f"a.agent_id = %s{in_namespaces}"),
        _ROW_SQL.format(level=2, where=f"{by_alias}{in_namespaces}"),
        _ROW_SQL.format(level=3, where=f"a.segment = %s{in_namespaces}"),
        # Aliases whatever their agent: one that points off the roster is its own answer.
        "SELECT 4, agent_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, "
        "NULL, NULL, NULL "
        "FROM directory_alias WHERE alias = %s" + in_targets,
    ]) + f" LIMIT {4 * MAX_CANDIDATES}"


_COLUMNS = ("level", *AGENT_FIELDS)


def _aware(value):
    # SQLite hands back text or naive UTC; PostgreSQL aware datetimes.
    if isinstance(value, str):
        value = parse_datetime(value)
    if value is not None and timezone.is_naive(value):
        value = value.replace(tzinfo=UTC)
    return value


def _mention_rows(*, agent_id: str, text: str,
                  namespaces: frozenset[str] | None = None) -> list[dict]:
    names = sorted(namespaces or ())
    # Namespaces are [a-z0-9_-]: only '_' is special to LIKE.
    prefixes = [name.replace("_", "!_") + ".%" for name in names]
    params = [agent_id, *names, text, *names, text, *names, text, *prefixes]
    with connection.cursor() as cursor:
        cursor.execute(_mention_sql(len(names)), params)
        raw = cursor.fetchall()
    rows = []
    for values in raw:
        row = dict(zip(_COLUMNS, values, strict=True))
        if row["level"] != 4:
            for key in ("lease_expires_at", "last_heartbeat_at", "registered_at"):
                row[key] = _aware(row[key])
        rows.append(row)
    return rows


def _by_mention(mention: str, *, namespace: str | None, target_node_id: str | None,
                now: datetime, namespaces: frozenset[str] | None = None) -> Resolution | None:
    text = alias_normalize(mention)
    if not text:
        return None
    level = "explicit" if target_node_id else "mention"
    agent_id = text.replace("/", ".", 1)
    if namespaces is not None and not namespaces:
        return None
    rows = _mention_rows(agent_id=agent_id, text=text, namespaces=namespaces)
    choose = {"level": level, "namespace": namespace, "target_node_id": target_node_id,
              "now": now}
    exact = [r for r in rows if r["level"] == 1]
    if exact:
        return _choose(exact, match="agent_id", what=f"agent id {agent_id}", **choose)
    by_alias = [r for r in rows if r["level"] == 2]
    if by_alias:
        return _choose(by_alias, match="alias", what=f"alias @{text}", **choose)
    dangling = [r["agent_id"] for r in rows if r["level"] == 4]
    if dangling:
        return Resolution(None, None, level,
                          f"alias @{text} points to {', '.join(dangling)}, which is not on "
                          "the roster", match="alias", outcome=NOT_FOUND)
    by_segment = [r for r in rows if r["level"] == 3]
    if by_segment:
        return _choose(by_segment, match="capability", what=f"capability segment {text}",
                       **choose)
    if len(text) >= 3:
        ids = agent_ids_containing(text, namespaces=namespaces)
        fuzzy = _agents(Q(agent_id__in=ids), namespaces) if ids else []
        if fuzzy:
            return _choose(fuzzy, match="substring", what=f"substring {text!r}", **choose)
    return None


class _AgentIdIndex:
    """Every agent id, kept in memory for the substring level: a LIKE '%x%' scan of the
    whole table costs milliseconds, a search of one string of all ids microseconds.
    Rebuilt when the roster's generation moves (any agent joining or leaving)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version: tuple | None = None
        self._ids = ""  # agent ids, one per line (ASCII by the id rules)
        self._lowered = ""  # the same, lowercased: same length, same offsets

    def containing(self, text: str, namespaces: frozenset[str] | None = None) -> list[str]:
        version = roster_generation()
        with self._lock:
            if version != self._version:
                ids = "\n".join(Agent.objects.order_by().values_list("agent_id", flat=True))
                self._ids, self._lowered, self._version = ids, ids.lower(), version
            ids, lowered = self._ids, self._lowered
        needle = text.lower()
        found: list[str] = []
        at = lowered.find(needle)
        while at >= 0 and len(found) < MAX_CANDIDATES:
            start = lowered.rfind("\n", 0, at) + 1
            end = lowered.find("\n", at)
            end = len(lowered) if end < 0 else end
            if _within(ids[start:end], namespaces):
                found.append(ids[start:end])
            at = lowered.find(needle, end)
        return found


_agent_ids = _AgentIdIndex()


def agent_ids_containing(text: str, *, namespaces: frozenset[str] | None = None) -> list[str]:
    return _agent_ids.containing(text, namespaces)


def _pid_definition(pid: str) -> str | None:
    row = ProcessInstance.objects.filter(pid=pid).values_list("definition_id", flat=True).first()
    if row:
        return row
    url = settings.REACH_PID_LOOKUP_URL
    if not url:
        return None
    query = urllib.parse.urlencode({"pid": pid})
    try:
        with urllib.request.urlopen(f"{url}?{query}", timeout=2) as response:  # noqa: S310
            body = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        log.warning("pid lookup %s failed for %s: %s", url, pid, exc)
        return None
    definition = body.get("definitionId") if isinstance(body, dict) else None
    return definition if isinstance(definition, str) and definition else None


def _by_binding(agent_id: str, *, level: str, what: str, namespace: str | None,
                target_node_id: str | None, now: datetime,
                namespaces: frozenset[str] | None = None) -> Resolution:
    if not _within(agent_id, namespaces):
        return Resolution(None, None, level, f"{what} is bound to an agent outside the "
                          "namespaces of this service token", outcome=NOT_FOUND)
    agents = _agents(Q(agent_id=agent_id), namespaces)
    if not agents:
        return Resolution(None, None, level, f"{what} is bound to {agent_id}, which is not on "
                          "the roster", outcome=NOT_FOUND)
    return _choose(agents, level=level, match=None, namespace=namespace,
                   target_node_id=target_node_id, now=now, what=what)


def resolve(*, mention: str | None = None, target_node_id: str | None = None,
            pid: str | None = None, scene_id: str | None = None, namespace: str | None = None,
            namespaces: frozenset[str] | None = None, now: datetime | None = None) -> Resolution:
    """`namespaces`: the caller's token is bound to these (None: unbound). Agents of other
    namespaces are never chosen, listed as candidates, or named in the reason."""
    now = now or timezone.now()
    target_node_id = target_node_id or None
    tried = []
    if mention:
        found = _by_mention(mention, namespace=namespace, target_node_id=target_node_id,
                            now=now, namespaces=namespaces)
        if found is not None:
            return found
        tried.append(f"mention {alias_normalize(mention)!r} matched no agent id, alias, "
                     "capability segment or name")
    if pid:
        definition = _pid_definition(pid)
        binding = (ProcessDefinitionBinding.objects.filter(definition_id=definition).first()
                   if definition else None)
        if binding:
            return _by_binding(binding.agent_id, level="pid", namespace=namespace,
                               what=f"pid {pid} (definition {definition})",
                               target_node_id=target_node_id, now=now, namespaces=namespaces)
        tried.append(f"pid {pid} has no process binding" if definition is None else
                     f"definition {definition} of pid {pid} is bound to no agent")
    if scene_id:
        scene = SceneBinding.objects.filter(scene_id=scene_id).first()
        if scene:
            return _by_binding(scene.agent_id, level="scene", namespace=namespace,
                               what=f"scene {scene_id}", target_node_id=target_node_id, now=now,
                               namespaces=namespaces)
        tried.append(f"scene {scene_id} has no binding")
    if not tried:
        return Resolution(None, None, None, "name a mention, a pid or a scene id to resolve",
                          outcome=NOT_FOUND)
    return Resolution(None, None, None, "; ".join(tried), outcome=NOT_FOUND)


def resolve_agent_node(
    *, to_agent_id: str, target_node_id: str | None = None, now: datetime | None = None,
    accepted: bool = False,
) -> Resolution:
    """The node that receives work addressed to an exact agent id: the explicit node first,
    else the roster's node for the agent; nothing else (no alias or fuzzy fall-back).
    `accepted`: work already accepted for this agent, which a drain lets finish on it
    (candidate_for)."""
    now = now or timezone.now()
    local_node = settings.REACH_NODE_ID
    if is_local_agent(to_agent_id) and target_node_id in (None, "", local_node):
        return Resolution(to_agent_id, local_node, "local", "handled by the console", local=True)
    agents = _agents(Q(agent_id=to_agent_id))
    if not agents and to_agent_id.count("/") == 2:
        return Resolution(None, None, None,
                          f"no Agent Card of {to_agent_id} is known: nothing is retained on "
                          f"{settings.REACH_A2A_ROOT}/discovery/{to_agent_id}, so no "
                          "A2A-over-MQTT agent answers there; check the id, or start the agent",
                          outcome=NOT_FOUND)
    if not agents:
        return Resolution(None, None, None,
                          f"no agent {to_agent_id} is on the roster; check the id or register "
                          "the agent", outcome=NOT_FOUND)
    candidate = candidate_for(agents[0], now, accepted=accepted)
    node_id = candidate.node_id
    if target_node_id and node_id != target_node_id:
        return Resolution(
            None, None, "explicit",
            f"node {target_node_id} does not host {to_agent_id}; the roster places it on "
            f"{node_id}. An explicit node is never swapped for another: send "
            f"to {node_id} or without targetNodeId",
            [candidate], outcome=NOT_FOUND,
        )
    level = "explicit" if target_node_id else "roster"
    if not candidate.routable:
        return Resolution(None, None, level,
                          f"{to_agent_id} on {node_id} cannot take work: {candidate.why}",
                          [candidate], outcome=NOT_DELIVERABLE)
    return Resolution(candidate.agent_id, node_id, level, "live",
                      [replace(candidate, chosen=True)])
