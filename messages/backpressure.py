"""Backpressure without a hot lock: per-agent in-flight and held counts, kept in
`a2a_agent_load` (messages.models.AgentLoad) instead of counted under a lock on every send
and every answer.

LOCK ORDER, for the whole console. Every transaction that takes more than one of these takes
them in this order, so two of them can wait for each other but never in a circle:
  1. a per-task advisory lock (PostgreSQL; sends only: the retry-storm guard counts a
     task's transmissions under it);
  2. `a2a_message` rows (FOR UPDATE; rows a transaction inserts are its own);
  3. `a2a_agent_load` rows, in agent id order (a transaction that takes them in two steps
     takes the same agents again: the bridge's batch moves counts, then releases held work
     for the agents it freed).
  Held message rows taken while a load row is held are claimed SKIP LOCKED, so that step
  never waits for (2). Work that needs a task's lock after (2) or (3) gets a transaction of
  its own: a reroute after BUSY runs after the batch commits, a due retry takes its task's
  lock before its row. The roster's own locks (a cluster node, then agents in agent id
  order: roster/services.py) are taken in the roster's own transactions, never together
  with these.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, F, Q
from django.db.models.functions import Greatest

from directory.resolver import resolve_agent_node
from messages.models import INFLIGHT_STATUSES, AgentLoad, Change, Direction, Message, Status
from messages.protocol import MessageType, inbox_topic, profile_request_topic
from roster.models import PROFILE_NODE_ID, Agent

log = logging.getLogger(__name__)

INFLIGHT, HELD = "inflight", "held"


def slot_of(row) -> str | None:
    """Which count a message row is in: a task request of ours that is held, or in flight."""
    if row.direction != Direction.SEND or row.message_type != MessageType.TASK_REQUEST:
        return None
    if row.status == Status.SENT and row.held:
        return HELD
    if row.status in INFLIGHT_STATUSES:
        return INFLIGHT
    return None


class Deltas:
    """Count changes collected while rows move, written once per agent at the end."""

    def __init__(self) -> None:
        self.by_agent: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def move(self, agent_id: str, before: str | None, after: str | None) -> None:
        if before == after:
            return
        for slot, sign in ((before, -1), (after, 1)):
            if slot == INFLIGHT:
                self.by_agent[agent_id][0] += sign
            elif slot == HELD:
                self.by_agent[agent_id][1] += sign

    def freed(self) -> set[str]:
        """Agents that have a slot more than before: held work may go."""
        return {a for a, (inflight, _) in self.by_agent.items() if inflight < 0}

    def write(self) -> None:
        for agent_id in sorted(self.by_agent):  # the lock order
            inflight, held = self.by_agent[agent_id]
            if inflight or held:
                AgentLoad.objects.filter(agent_id=agent_id).update(
                    inflight=Greatest(F("inflight") + inflight, 0),
                    held=Greatest(F("held") + held, 0))


@dataclass
class AgentCapacity:
    # None: the agent has no limit right now, being off the roster since it was resolved
    # (a deregistration between the two). Its work goes out as resolved, and is counted.
    max_inflight: int | None
    inflight: int = 0
    held: int = 0

    def decide(self) -> str:
        """'publish', 'hold' or 'busy' for one more message, and count it."""
        if self.max_inflight is None:
            self.inflight += 1
            return "publish"
        if self.inflight < self.max_inflight and not self.held:
            self.inflight += 1
            return "publish"
        if self.held < settings.REACH_QUEUE_LIMIT:
            self.held += 1
            return "hold"
        return "busy"


class Capacities:
    """The locked load rows of the agents one transaction sends to or releases for."""

    def __init__(self, loads: dict[str, AgentLoad], limits: dict[str, int]):
        self.loads = loads
        self.agents = {
            agent_id: AgentCapacity(
                max_inflight=(limits[agent_id] or 1) if agent_id in limits else None,
                inflight=load.inflight, held=load.held)
            for agent_id, load in loads.items()}

    def decide(self, agent_id: str) -> str:
        capacity = self.agents.get(agent_id)
        return capacity.decide() if capacity else "publish"

    def write(self) -> None:
        for agent_id in sorted(self.agents):
            capacity, load = self.agents[agent_id], self.loads[agent_id]
            if (capacity.inflight, capacity.held) != (load.inflight, load.held):
                AgentLoad.objects.filter(pk=load.pk).update(inflight=capacity.inflight,
                                                            held=capacity.held)
                load.inflight, load.held = capacity.inflight, capacity.held


def loads_lock(agent_ids: Iterable[str]) -> Capacities:
    """Lock the load rows of these agents (creating missing ones), in agent id order."""
    ids = sorted(set(agent_ids))
    if not ids:
        return Capacities({}, {})
    AgentLoad.objects.bulk_create([AgentLoad(agent_id=a) for a in ids], ignore_conflicts=True)
    loads = {load.agent_id: load for load in
             AgentLoad.objects.select_for_update().filter(agent_id__in=ids).order_by("agent_id")}
    limits = dict(Agent.objects.filter(agent_id__in=ids).values_list("agent_id", "max_inflight"))
    return Capacities(loads, limits)


def task_locks(task_ids: Iterable[str]) -> None:
    """Serialize concurrent sends of one task (the retry-storm guard counts under it). On
    SQLite every write transaction is serialized already."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        for task_id in sorted(set(task_ids)):
            cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [task_id])


def loads_of(agent_ids: Iterable[str]) -> dict[str, int]:
    """What the console has sent each agent and not yet seen answered (in flight + held)."""
    return {agent_id: inflight + held for agent_id, inflight, held in
            AgentLoad.objects.filter(agent_id__in=list(agent_ids))
            .values_list("agent_id", "inflight", "held")}


def held_release(*, agent_ids: Iterable[str], now: datetime) -> tuple[list[int], list]:
    """Let held messages go, oldest first, as far as each agent has free slots.

    Runs in the caller's transaction. Returns (pks now due in the outbox, status changes
    for held messages whose agent can no longer take work: they become UNDELIVERABLE).
    """
    publish: list[int] = []
    changes: list[Change] = []
    capacities = loads_lock(agent_ids)
    for agent_id, load in capacities.loads.items():
        if load.held <= 0:
            continue
        # SKIP LOCKED: a row another transaction holds (ending it at its deadline) is not
        # waited for while this one holds the load row (the lock order above).
        held = (Message.objects.select_for_update(skip_locked=True)
                .filter(direction=Direction.SEND, to_agent_id=agent_id, held=True,
                        message_type=MessageType.TASK_REQUEST, status=Status.SENT)
                .exclude(deadline_at__lte=now)  # messages/sweeps.py ends those
                .order_by("created_at", "id"))
        # Held work was accepted for this agent: a drain lets it finish there (only new work
        # goes elsewhere); it ends only when the agent can take nothing at all.
        resolution = resolve_agent_node(to_agent_id=agent_id, now=now, accepted=True)
        if not resolution.ok:
            reason = f"held for {agent_id}, which can no longer take work: {resolution.reason}"
            changes += [Change(pk=pk, to=Status.UNDELIVERABLE, allowed=frozenset({Status.SENT}),
                               actor="sweeper", reason=reason,
                               fields={"error": reason, "finished_at": now, "held": False})
                        for pk in held.values_list("pk", flat=True)]
            continue
        capacity = capacities.agents.get(agent_id)
        if capacity is None or capacity.max_inflight is None:
            continue  # off the roster when its limit was read: the next release sees it
        free = capacity.max_inflight - capacity.inflight
        if free <= 0:
            continue
        node = resolution.node_id
        pks, swapped = [], []
        for pk, target, level in held.values_list("pk", "target_node_id",
                                                  "resolution__level")[:free]:
            # An explicit node is never swapped for another (PROTOCOL.md): if the agent left
            # it while the work was held, the work ends instead of following the agent.
            (swapped if level == "explicit" and target != node else pks).append(pk)
        for pk in swapped:
            reason = (f"held for {agent_id}, which has moved to {node}; the explicit node "
                      "named at send time is never swapped for another")
            changes.append(Change(pk=pk, to=Status.UNDELIVERABLE, allowed=frozenset({Status.SENT}),
                                  actor="sweeper", reason=reason,
                                  fields={"error": reason, "finished_at": now, "held": False}))
        if not pks:
            continue
        # To the node the agent lives on now, which may not be the one it had when held.
        # An agent of the A2A-over-MQTT profile keeps its own request topic.
        topic = (profile_request_topic(settings.REACH_A2A_ROOT, agent_id)
                 if node == PROFILE_NODE_ID else inbox_topic(settings.MQTT_TOPIC_PREFIX, node))
        released = Message.objects.filter(pk__in=pks, held=True, status=Status.SENT).update(
            held=False, publish_at=now, updated_at=now, target_node_id=node, topic=topic)
        capacity.held -= released
        capacity.inflight += released
        publish += pks
    capacities.write()
    return publish, changes


def loads_kept(agent_ids: Iterable[str]) -> dict[str, tuple[int, int]]:
    """Each agent's kept (in flight, held) counts: what backpressure and capability routing
    go by, one row an agent. Registered with the roster (messages/apps.py) so its pages show
    the load the console routes by without importing this app."""
    return {agent_id: (max(0, inflight), max(0, held)) for agent_id, inflight, held in
            AgentLoad.objects.filter(agent_id__in=list(agent_ids))
            .values_list("agent_id", "inflight", "held")}


def loads_to_release() -> list[str]:
    """Agents with held work, the least busy first (most likely to have room), so that past
    the batch's size no agent waits behind the same others on every sweep."""
    return list(AgentLoad.objects.filter(held__gt=0).order_by("inflight", "agent_id")
                .values_list("agent_id", flat=True)[:500])


def loads_reconcile() -> int:
    """Set every kept count to what the message rows say; returns how many were off.

    Counted after locking the load rows: a transaction that changed rows but not yet its
    load row waits for us, and its change is relative to what we counted, so the two agree.
    """
    with transaction.atomic():
        active = set(Message.objects.filter(
            direction=Direction.SEND, message_type=MessageType.TASK_REQUEST,
            status__in=list(INFLIGHT_STATUSES)).values_list("to_agent_id", flat=True).distinct())
        kept = set(AgentLoad.objects.filter(Q(inflight__gt=0) | Q(held__gt=0))
                   .values_list("agent_id", flat=True))
        capacities = loads_lock(active | kept)
        counts = {row["to_agent_id"]: row for row in Message.objects.filter(
            direction=Direction.SEND, message_type=MessageType.TASK_REQUEST,
            to_agent_id__in=list(capacities.loads), status__in=list(INFLIGHT_STATUSES))
            .values("to_agent_id").annotate(
                inflight=Count("id", filter=~Q(held=True, status=Status.SENT)),
                held=Count("id", filter=Q(held=True, status=Status.SENT)))}
        off = 0
        for agent_id, load in capacities.loads.items():
            row = counts.get(agent_id, {"inflight": 0, "held": 0})
            if (load.inflight, load.held) != (row["inflight"], row["held"]):
                off += 1
                log.warning("load of %s was %d in flight / %d held, the rows say %d / %d",
                            agent_id, load.inflight, load.held, row["inflight"], row["held"])
                AgentLoad.objects.filter(pk=load.pk).update(inflight=row["inflight"],
                                                            held=row["held"])
    return off
