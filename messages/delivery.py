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
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count

from messages.models import Direction, Message, Status
from messages.protocol import MessageType

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
                                   message_type=MessageType.TASK_REQUEST)
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


# --- backpressure (the counts: messages/backpressure.py) ------------------------------------
def busy_reason(agent_id: str) -> str:
    return (f"{agent_id} already has {settings.REACH_QUEUE_LIMIT} messages held behind its "
            "maxInflight (REACH_QUEUE_LIMIT): BUSY, send elsewhere or later")
