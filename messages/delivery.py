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
from roster.models import Dialect

_rng = random.SystemRandom()


def retry_delay_ms(attempt: int, *, rng: random.Random | None = None) -> float:
    """The wait before attempt `attempt + 1`, after `attempt` failed (attempt ≥ 1)."""
    base = min(settings.REACH_RETRY_MAX_MS,
               settings.REACH_RETRY_BASE_MS * settings.REACH_RETRY_MULTIPLIER ** (attempt - 1))
    jitter = settings.REACH_RETRY_JITTER
    # Jitter spreads retries that failed together (paho's own backoff has none).
    return base * (1 + (rng or _rng).uniform(-jitter, jitter))


def ack_deadline(now: datetime, *, ack_ms: int | None = None) -> datetime:
    return now + timedelta(milliseconds=ack_ms or settings.REACH_ACK_TIMEOUT_MS)


# A row of the A2A-over-MQTT profile (messages/profile_send.py) follows the profile's
# requester rules instead: its first reply within REACH_A2A_FIRST_REPLY_MS stands for the
# ACK, and its attempts and backoff are the profile's.
def _profile(row: Message) -> bool:
    return (row.headers or {}).get("dialect") == Dialect.A2A_MQTT


def silence_words(row: Message) -> str:
    if _profile(row):
        return (f"no reply within {settings.REACH_A2A_FIRST_REPLY_MS} ms "
                "(REACH_A2A_FIRST_REPLY_MS, the profile's first-reply timeout)")
    return f"no ACK within {settings.REACH_ACK_TIMEOUT_MS} ms"


def _profile_delay_ms(attempt: int, rng: random.Random | None = None) -> float:
    backoff = settings.REACH_A2A_BACKOFF_MS
    base = backoff[min(attempt - 1, len(backoff) - 1)]
    jitter = settings.REACH_A2A_JITTER
    return base * (1 + (rng or _rng).uniform(-jitter, jitter))


def retry_or_give_up(row: Message, *, now: datetime) -> tuple[str, dict, str]:
    """After an attempt failed: (next status, fields, reason) — RETRYING with its due time,
    or the terminal status with words, when attempts or the task's time ran out."""
    if _profile(row):
        if row.attempt >= settings.REACH_A2A_MAX_ATTEMPTS:
            return "", {}, (f"{row.attempt} attempts made, each with its own Correlation "
                            "Data (REACH_A2A_MAX_ATTEMPTS, the profile's requester rule)")
        delay = _profile_delay_ms(row.attempt)
    else:
        if row.attempt >= settings.REACH_RETRY_MAX_ATTEMPTS:
            return "", {}, f"{row.attempt} attempts made (REACH_RETRY_MAX_ATTEMPTS)"
        delay = retry_delay_ms(row.attempt)
    due = now + timedelta(milliseconds=delay)
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
