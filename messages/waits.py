"""Waiting for a task's answer (`POST /api/a2a/send` with `wait: true`) without holding
anything: no database connection and no thread while it waits, so hundreds of callers
waiting on slow agents cost the API nothing (each used to hold one of the process's pooled
connections for up to `timeoutMs`, and nine of them made every other call 503).

Each process that serves the API listens, while somebody in it waits, on one channel-layer
group that the event publisher feeds with the ends of task requests (messages/events.py,
ANSWERS_GROUP; nothing is sent to it while nobody listens). A waiter sleeps on an asyncio
future until its task's end comes by, then reads once. Pushes are hints, as everywhere on
the stream: a waiter also reads at a few moments of its own (in its first second, unless
pushes have reached this process for longer than the publishers take to learn that it
listens; then every CHECK_EVERY_S, more often while pushes do not arrive), so a lost push
or a channel layer that is down costs only a late answer.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
import time
from collections import defaultdict

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer

from messages.events import ANSWERS_GROUP, interest_register
from reachconsole.core.outages import unavailable_reason

log = logging.getLogger(__name__)

# Reads of their own, in seconds after the wait starts: the interest a publisher reads is
# cached for a second (messages/events.py), then a slow safety net.
EARLY_CHECKS_S = (0.25, 0.6, 1.2)
SETTLED_S = 1.5  # pushes reach this process and every publisher knows: no early reads
CHECK_EVERY_S = 10.0  # while pushes reach this process
CHECK_DEAF_S = 3.0  # while they do not (no listener yet, or the channel layer is down)
JITTER = 0.2  # waiters that started together do not read together
INTEREST_RENEW_S = 30.0
# The listener stops once nobody has waited for this long, and leaves the group.
IDLE_STOP_S = 60.0
PROBE = "answers.probe"


class AnswerWaits:
    """The waiters of this process, keyed by task id, and the one listener that wakes
    them. Lives on the process's event loop (Daphne's)."""

    def __init__(self) -> None:
        self._waiting: dict[str, set[asyncio.Future]] = defaultdict(set)
        self._listener: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.live: asyncio.Event | None = None  # set while pushes reach this process
        self._live_since: float | None = None
        self._failed_at = -3600.0
        self._logged_at = -3600.0
        self.woken = 0
        self.pushes = 0

    def _ensure_listening(self) -> None:
        loop = asyncio.get_running_loop()
        if self._listener is not None and not self._listener.done() and self._loop is loop:
            return
        if self._loop is loop and time.monotonic() - self._failed_at < CHECK_DEAF_S:
            return  # the last one failed just now: not one attempt per waiter and read
        self._loop = loop
        self.live = asyncio.Event()
        # A context of its own: created inside a request, the listener would otherwise
        # carry that request's thread-sensitive context past its end.
        self._listener = loop.create_task(self._listen(), context=contextvars.Context())

    async def wait(self, task_id: str, *, timeout_s: float, check) -> object | None:
        """Until `check()` (an async read) gives something other than None, or `timeout_s`
        passes: None then. `check` runs at the start, on each push for this task id and
        at the moments above."""
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        self._ensure_listening()
        early = [] if self._settled() else list(EARLY_CHECKS_S)
        loop = asyncio.get_running_loop()
        while True:
            self._ensure_listening()  # each time: it may have stopped, idle, meanwhile
            # Registered before the read: an end that comes by while it runs is not missed.
            future = loop.create_future()
            self._waiting[task_id].add(future)
            try:
                try:
                    result = await check()
                except Exception as exc:
                    # A read that found the database busy or away: the wait goes on, and
                    # the read at its end answers 503 if it still is.
                    if unavailable_reason(exc) is None:
                        raise
                    result = None
                if result is not None:
                    return result
                now = time.monotonic()
                if now >= deadline:
                    return None
                elapsed = now - started
                while early and early[0] <= elapsed:
                    early.pop(0)
                if early:
                    pause = early[0] - elapsed
                else:
                    every = CHECK_EVERY_S if self.live.is_set() else CHECK_DEAF_S
                    pause = every * random.uniform(1 - JITTER, 1 + JITTER)  # noqa: S311
                try:
                    await asyncio.wait_for(future, min(pause, deadline - now))
                    self.woken += 1
                except TimeoutError:
                    pass
            finally:
                self._forget(task_id, future)

    def _settled(self) -> bool:
        return (self.live is not None and self.live.is_set() and self._live_since is not None
                and time.monotonic() - self._live_since >= SETTLED_S)

    def _forget(self, task_id: str, future: asyncio.Future) -> None:
        futures = self._waiting.get(task_id)
        if futures is not None:
            futures.discard(future)
            if not futures:
                del self._waiting[task_id]

    def _wake(self, events: list[dict]) -> None:
        for event in events:
            futures = self._waiting.get(event.get("taskId") or "")
            if futures:
                for future in list(futures):
                    if not future.done():
                        future.set_result(None)

    async def _listen(self) -> None:
        channel = ""
        keeper = None
        layer = None
        try:
            # Inside the try: making the layer may fail too (its prefix, the console's name,
            # is read from the database: reachconsole/core/identity.py).
            layer = get_channel_layer()
            if layer is None:
                return  # no channel layer: the waiters' own reads find the answer
            channel = await layer.new_channel("answers.")
            await layer.group_add(ANSWERS_GROUP, channel)
            keeper = asyncio.create_task(self._keep())
            # Subscribing may complete after group_add returns (Redis pub/sub): the probe
            # coming back says pushes reach this process from now on.
            await layer.group_send(ANSWERS_GROUP, {"type": PROBE})
            while True:
                # Never under a timeout: a receive cancelled unsubscribes (channels_redis).
                frame = await layer.receive(channel)
                if frame.get("type") == PROBE:
                    if not self.live.is_set():
                        self._live_since = time.monotonic()
                        self.live.set()
                    continue
                self.pushes += 1
                self._wake(frame.get("events") or [])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Redis down, most likely: the waiters read on their own, and one of them starts
            # a new listener a few seconds on. Said once a minute, not once per attempt.
            self._failed_at = time.monotonic()
            if self._failed_at - self._logged_at >= 60.0:
                self._logged_at = self._failed_at
                log.warning("not listening for task answers (%s: %s); waiters read the "
                            "table every %.0f s", type(exc).__name__, exc, CHECK_DEAF_S)
        finally:
            self.live.clear()
            self._live_since = None
            if keeper is not None and keeper is not asyncio.current_task():
                keeper.cancel()
            if channel and layer is not None:
                try:
                    await layer.group_discard(ANSWERS_GROUP, channel)
                except Exception:  # noqa: BLE001, S110 - leaving is best effort; the group expires
                    pass

    async def _keep(self) -> None:
        """Keep the publishers' interest fresh; stop the listener once nobody in this
        process has waited for IDLE_STOP_S."""
        last_waited = time.monotonic()
        while True:
            if self._waiting:
                last_waited = time.monotonic()
            elif time.monotonic() - last_waited >= IDLE_STOP_S:
                if self._listener is not None:
                    self._listener.cancel()
                return
            try:
                await sync_to_async(interest_register, thread_sensitive=False)(ANSWERS_GROUP)
            except Exception as exc:  # the cache (Redis) is down: pushes may not come
                log.warning("could not say that this process waits for task answers "
                            "(%s: %s)", type(exc).__name__, exc)
            await asyncio.sleep(INTEREST_RENEW_S)


answer_waits = AnswerWaits()
