"""Reliable delivery: bounded retries, the retry-storm guard, backpressure per agent.

At-least-once delivery with a bound: a transmission that is not acknowledged by its ack
deadline, or is refused with a retryable NACK, becomes a new attempt (a new row, same task id
and idempotency key) after `min(max, base × multiplier^(n-1))` ± jitter, at most
REACH_RETRY_MAX_ATTEMPTS times and never past the task's own deadline. One task id is not
transmitted to one agent more than REACH_TASK_MAX_SENDS times in REACH_TASK_WINDOW_S seconds,
whoever asks. An agent with maxInflight unacknowledged messages gets no more: the rest wait,
held in order, and past REACH_QUEUE_LIMIT held a send answers BUSY at once.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, Q

from messages.models import INFLIGHT_STATUSES, Direction, Message, Status
from roster.models import Agent

_rng = random.SystemRandom()


def retry_delay_ms(attempt: int, *, rng: random.Random | None = None) -> float:
    """The wait before attempt `attempt + 1`, after `attempt` failed (attempt ≥ 1)."""
    base = min(settings.REACH_RETRY_MAX_MS,
               settings.REACH_RETRY_BASE_MS * settings.REACH_RETRY_MULTIPLIER ** (attempt - 1))
    jitter = settings.REACH_RETRY_JITTER
    # Jitter spreads retries that failed together (paho's own backoff has none).
    return base * (1 + (rng or _rng).uniform(-jitter, jitter))


def ack_deadline(now: datetime) -> datetime:
    return now + timedelta(milliseconds=settings.REACH_ACK_TIMEOUT_MS)


def retry_or_give_up(row: Message, *, now: datetime) -> tuple[str, dict, str]:
    """After an attempt failed: (next status, fields, reason) — RETRYING with its due time,
    or the terminal status with words, when attempts or the task's time ran out."""
    if row.attempt >= settings.REACH_RETRY_MAX_ATTEMPTS:
        return "", {}, f"{row.attempt} attempts made (REACH_RETRY_MAX_ATTEMPTS)"
    due = now + timedelta(milliseconds=retry_delay_ms(row.attempt))
    if row.deadline_at and due >= row.deadline_at:
        return "", {}, "the task's deadline (timeoutMs) would pass before another attempt"
    return Status.RETRYING, {"next_attempt_at": due}, f"attempt {row.attempt + 1} due"


# --- the retry-storm guard ---------------------------------------------------------------------
def transmissions_in_window(pairs: Iterable[tuple[str, str]], *, now: datetime) -> Counter:
    """How often each (task id, agent) was transmitted in the window, console-wide."""
    pairs = set(pairs)
    if not pairs:
        return Counter()
    since = now - timedelta(seconds=settings.REACH_TASK_WINDOW_S)
    rows = (Message.objects.filter(direction=Direction.SEND, created_at__gte=since,
                                   task_id__in={task for task, _ in pairs},
                                   message_type="TASK_REQUEST")
            .values("task_id", "to_agent_id").annotate(n=Count("id")))
    return Counter({(r["task_id"], r["to_agent_id"]): r["n"] for r in rows
                    if (r["task_id"], r["to_agent_id"]) in pairs})


def storm_refusal(task_id: str, agent_id: str, sent: int) -> str | None:
    limit, window = settings.REACH_TASK_MAX_SENDS, settings.REACH_TASK_WINDOW_S
    if sent < limit:
        return None
    return (f"task {task_id} was already transmitted {sent} times to {agent_id} in the last "
            f"{window} s (REACH_TASK_MAX_SENDS={limit}); the retry-storm guard refuses more. "
            "Wait, or find out why the receiver does not acknowledge it")


# --- backpressure ------------------------------------------------------------------------------
@dataclass
class AgentCapacity:
    max_inflight: int
    inflight: int = 0
    held: int = 0

    def decide(self) -> str:
        """'publish', 'hold' or 'busy' for one more message, and count it."""
        if self.inflight < self.max_inflight and not self.held:
            self.inflight += 1
            return "publish"
        if self.held < settings.REACH_QUEUE_LIMIT:
            self.held += 1
            return "hold"
        return "busy"


@dataclass
class Capacities:
    agents: dict[str, AgentCapacity] = field(default_factory=dict)

    def decide(self, agent_id: str) -> str:
        capacity = self.agents.get(agent_id)
        return capacity.decide() if capacity else "publish"


def capacities_lock(agent_ids: Iterable[str]) -> Capacities:
    """Lock the agents' roster rows (so concurrent sends to one agent queue up behind each
    other) and count what is in flight and held for each."""
    ids = sorted(set(agent_ids))
    if not ids:
        return Capacities()
    # Always locked in agent id order (as heartbeat_record does), so two transactions
    # locking overlapping agents cannot deadlock.
    limits = dict(Agent.objects.select_for_update().filter(agent_id__in=ids)
                  .order_by("agent_id").values_list("agent_id", "max_inflight"))
    # Only task requests occupy a slot: the console's own ACKs are never answered.
    counts = (Message.objects.filter(direction=Direction.SEND, to_agent_id__in=list(limits),
                                     message_type="TASK_REQUEST",
                                     status__in=list(INFLIGHT_STATUSES))
              .values("to_agent_id").annotate(
                  inflight=Count("id", filter=Q(held=False)),
                  held=Count("id", filter=Q(held=True))))
    capacities = {agent_id: AgentCapacity(max_inflight=limit or 1)
                  for agent_id, limit in limits.items()}
    for row in counts:
        capacity = capacities[row["to_agent_id"]]
        capacity.inflight, capacity.held = row["inflight"], row["held"]
    return Capacities(capacities)


def busy_reason(agent_id: str) -> str:
    return (f"{agent_id} already has {settings.REACH_QUEUE_LIMIT} messages held behind its "
            "maxInflight (REACH_QUEUE_LIMIT): BUSY, send elsewhere or later")


def held_release(*, agent_ids: Iterable[str], now: datetime) -> tuple[list[int], list]:
    """Let held messages go, oldest first, as far as each agent has free slots.

    Runs in the caller's transaction. Returns (pks to publish after commit, status changes
    for held messages whose agent can no longer take work: they become UNDELIVERABLE).
    """
    from directory.resolver import resolve_agent_node
    from messages.state import Change

    publish: list[int] = []
    changes: list[Change] = []
    agent_ids = set(agent_ids)
    capacities = capacities_lock(agent_ids)
    # An agent that left the roster has no capacity row: its held work must still end.
    gone = {a: AgentCapacity(max_inflight=0, held=1) for a in agent_ids - set(capacities.agents)}
    sent = frozenset({Status.SENT})
    for agent_id, capacity in {**capacities.agents, **gone}.items():
        if not capacity.held:
            continue
        held = Message.objects.filter(direction=Direction.SEND, to_agent_id=agent_id, held=True,
                                      message_type="TASK_REQUEST",
                                      status=Status.SENT).order_by("created_at", "id")
        late = "the task's deadline (timeoutMs) passed while it was held"
        changes += [Change(pk=pk, to=Status.EXPIRED, allowed=sent, actor="sweeper", reason=late,
                           fields={"error": late, "finished_at": now, "held": False})
                    for pk in held.filter(deadline_at__lte=now).values_list("pk", flat=True)]
        held = held.exclude(deadline_at__lte=now)
        resolution = resolve_agent_node(to_agent_id=agent_id, now=now)
        if not resolution.ok:
            reason = f"held for {agent_id}, which can no longer take work: {resolution.reason}"
            changes += [Change(pk=pk, to=Status.UNDELIVERABLE, allowed=frozenset({Status.SENT}),
                               actor="sweeper", reason=reason,
                               fields={"error": reason, "finished_at": now, "held": False})
                        for pk in held.values_list("pk", flat=True)]
            continue
        free = capacity.max_inflight - capacity.inflight
        if free <= 0:
            continue
        pks = list(held.values_list("pk", flat=True)[:free])
        Message.objects.filter(pk__in=pks, held=True, status=Status.SENT).update(
            held=False, ack_deadline_at=ack_deadline(now), updated_at=now)
        publish += pks
    return publish, changes
