"""`a2a_message` and `a2a_failed` events, sent after commit, coalesced per channel group.

One channel-layer message per group per flush carries every event of that flush: sending one
per event caps the console far below its ingest rate (about 180 `async_to_sync(group_send)`
calls a second from a thread here). The sends run on one long-lived event loop: a private
one in a worker, or the ASGI server's own loop in the one-process console, where the
in-memory channel layer must be used from the loop its consumers live on.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.core.cache import cache
from django.db import transaction

from messages.models import DONE_STATUSES, FAILURE_STATUSES, FINAL_STATUSES, Message
from messages.protocol import MessageType
from messages.rows import message_fields
from messages.tally import events_count

log = logging.getLogger(__name__)

EVENT_MESSAGE = "a2a_message"
EVENT_FAILED = "a2a_failed"
TIMELINE_GROUP = "a2a.timeline"
SKILL_PROGRESS_GROUP = "a2a.skill_progress"
# The ends of task requests, for the API processes where somebody waits for an answer
# (messages/waits.py); sent only while one listens (interest, below).
ANSWERS_GROUP = "a2a.answers"
FRAME_TYPE = "a2a.events"  # handled by consumers' a2a_events()
MAX_EVENTS_PER_FRAME = 500
MAX_PENDING_FLUSHES = 1000


def _hashed(kind: str, value: str) -> str:
    # Group names allow only a small alphabet and 100 characters; ids are arbitrary text.
    return f"a2a.{kind}.{hashlib.sha1(value.encode()).hexdigest()[:24]}"  # noqa: S324


def conversation_group(conversation_id: str) -> str:
    return _hashed("conv", conversation_id)


def scene_group(scene_group_id: str) -> str:
    return _hashed("scene", scene_group_id)


def session_group(session_id: str) -> str:
    return _hashed("session", session_id)


ENDS = DONE_STATUSES | FINAL_STATUSES


def event_groups(event: dict[str, Any]) -> list[str]:
    """The timeline, plus the conversation's, else the scene's, else the session's group;
    and the answers' group for a task request that reached an end."""
    if event.get("conversationId"):
        scoped = conversation_group(event["conversationId"])
    elif event.get("sceneGroupId"):
        scoped = scene_group(event["sceneGroupId"])
    elif event.get("sessionId"):
        scoped = session_group(event["sessionId"])
    else:
        scoped = SKILL_PROGRESS_GROUP
    if (event.get("messageType") == MessageType.TASK_REQUEST and event.get("status") in ENDS
            and event.get("event") == EVENT_MESSAGE):
        return [TIMELINE_GROUP, scoped, ANSWERS_GROUP]
    return [TIMELINE_GROUP, scoped]


def message_events(message: Message, *, previous: str, reason: str = "") -> list[dict]:
    body = {"id": message.pk, **message_fields(message), "previousStatus": previous or None,
            "reason": reason or None, "at": message.updated_at.isoformat()}
    events = [{"event": EVENT_MESSAGE, **body}]
    if message.status in FAILURE_STATUSES and previous not in FAILURE_STATUSES:
        events.append({"event": EVENT_FAILED, **body})
    return events


ALWAYS_SENT = frozenset({TIMELINE_GROUP, SKILL_PROGRESS_GROUP})
INTEREST_PREFIX = "ws-interest:"
INTEREST_TTL_S = 120
_interest_cache: dict[str, tuple[float, bool]] = {}
INTEREST_CACHE_S = 1.0


def interest_register(group: str) -> None:
    """A socket listens to a conversation's (scene's, session's) group: say so, for the
    publisher. Sockets renew it while they stay connected."""
    if group not in ALWAYS_SENT:
        cache.set(INTEREST_PREFIX + group, 1, timeout=INTEREST_TTL_S)


def interest_in(groups: list[str]) -> set[str]:
    """Which of these scoped groups have a listener. Sending a frame to a group nobody
    listens to costs a channel-layer call per conversation; with many conversations on the
    bus that was most of the event cost per message (docs/performance.md). Answers are
    reused for a second, so a new listener may miss up to a second of pushes (pages re-read
    the table anyway)."""
    now = time.monotonic()
    known = {g: v for g in groups
             if (v := _interest_cache.get(g)) and now - v[0] < INTEREST_CACHE_S}
    unknown = [g for g in groups if g not in known]
    if unknown:
        found = cache.get_many([INTEREST_PREFIX + g for g in unknown])
        for g in unknown:
            known[g] = (now, INTEREST_PREFIX + g in found)
            _interest_cache[g] = known[g]
    return {g for g, (_, listened) in known.items() if listened}


def interest_cached(groups: list[str]) -> set[str] | None:
    """`interest_in` from this process's memory alone: None when an answer is missing or
    older than INTEREST_CACHE_S (then ask `interest_in`, which reads the cache)."""
    now = time.monotonic()
    listened = set()
    for group in groups:
        seen = _interest_cache.get(group)
        if seen is None or now - seen[0] >= INTEREST_CACHE_S:
            return None
        if seen[1]:
            listened.add(group)
    return listened


class EventPublisher:
    """Hands batches of events to the channel layer from one event loop."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.sent_frames = 0
        self.sent_events = 0
        self.failures = 0
        self.pending = 0
        self.dropped = 0
        self._unlogged = 0
        self._logged_at = -60.0

    def bind_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Send on `loop` (the ASGI server's) from now on; None: back to a private loop."""
        with self._lock:
            self._loop = loop

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is not None and not self._loop.is_closed():
                return self._loop
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=loop.run_forever, name="a2a-events", daemon=True
            )
            self._thread.start()
            self._loop = loop
            return loop

    def publish(self, events: Iterable[dict]) -> asyncio.Future | None:
        frames: dict[str, list[dict]] = defaultdict(list)
        for event in events:
            for group in event_groups(event):
                frames[group].append(event)
        if not frames:
            return None
        with self._lock:
            if self.pending >= MAX_PENDING_FLUSHES:
                # The channel layer is not keeping up: drop this push rather than queue
                # without bound. Pages re-read the table, so a dropped hint loses nothing.
                self.dropped += 1
                return None
            self.pending += 1
        future = asyncio.run_coroutine_threadsafe(self._send(frames), self._ensure_loop())
        future.add_done_callback(self._done)
        return future

    def _done(self, _future) -> None:
        with self._lock:
            self.pending -= 1

    async def _send(self, frames: dict[str, list[dict]]) -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        # The always-sent groups (the timeline every open page listens to) go first: they
        # need no interest lookup, and waiting for one put a thread hop and, once a second,
        # a Redis round trip in front of every page's frame (bench/stream_latency.py).
        scoped = [g for g in frames if g not in ALWAYS_SENT]
        for group, events in frames.items():
            if group in ALWAYS_SENT:
                await self._send_group(layer, group, events)
        if not scoped:
            return
        # Answered from this process's memory when it can: a hop to a thread costs more
        # than the lookup while the bridge's owner thread holds the GIL.
        listened = interest_cached(scoped)
        if listened is None:
            try:
                listened = await sync_to_async(interest_in, thread_sensitive=False)(scoped)
            except Exception as exc:  # the cache (Redis) is down: the always-sent only
                self._failed(sum(len(frames[g]) for g in scoped), "the interest cache", exc)
                return
        for group in scoped:
            if group in listened:
                await self._send_group(layer, group, frames[group])

    async def _send_group(self, layer, group: str, events: list[dict]) -> None:
        for start in range(0, len(events), MAX_EVENTS_PER_FRAME):
            chunk = events[start : start + MAX_EVENTS_PER_FRAME]
            try:
                await layer.group_send(group, {"type": FRAME_TYPE, "events": chunk})
                self.sent_frames += 1
                self.sent_events += len(chunk)
            except Exception as exc:
                # A push is a hint (pages re-read the table on a gap); never let a
                # channel-layer hiccup reach the code that wrote the rows.
                self._failed(len(chunk), group, exc)

    def _failed(self, count: int, where: str, exc: Exception) -> None:
        """Count a failed push; say so once a minute, not once per batch: while Redis is
        down every batch fails, and a traceback each would bury what an operator needs."""
        self.failures += 1
        self._unlogged += count
        now = time.monotonic()
        if now - self._logged_at >= 60.0:
            log.warning("could not push %d events (last to %s: %s: %s); pages re-read the "
                        "table", self._unlogged, where, type(exc).__name__, exc)
            self._unlogged, self._logged_at = 0, now


publisher = EventPublisher()


def events_on_commit(events: list[dict]) -> None:
    """Send `events` once the current transaction commits, and count the changes they
    announce (messages/tally.py); nothing if it rolls back."""
    if events:
        transaction.on_commit(lambda: _committed(events))


def _committed(events: list[dict]) -> None:
    publisher.publish(events)
    events_count(events)
