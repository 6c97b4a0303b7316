"""WebSocket consumers: they forward events, nothing else.

A frame carries a batch: `{"events": [{"event": "a2a_message", …}, {"event": "a2a_failed", …}]}`;
each event keeps its name. A push is a hint: the page remembers the last row id it saw and
reads the table for what it missed. A client too slow to keep up is closed (code 4008),
never buffered without bound.
"""

from __future__ import annotations

import asyncio
import logging

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from messages.events import (
    INTEREST_TTL_S,
    SKILL_PROGRESS_GROUP,
    TIMELINE_GROUP,
    conversation_group,
    interest_register,
    scene_group,
    session_group,
)
from reachconsole.core.roles import may_read

log = logging.getLogger(__name__)

SOCKET_QUEUE_FRAMES = 256
CLOSE_TOO_SLOW = 4008
CLOSE_UNAUTHORIZED = 4401
CLOSE_NO_ROLE = 4403  # signed in, but the account may not read the console


class EventStreamConsumer(AsyncJsonWebsocketConsumer):
    group: str = TIMELINE_GROUP

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            # Accept, then close with a code: a close before accept becomes an HTTP 403 at
            # the handshake, which a browser reports as 1006 like any network failure, so
            # the page would retry forever instead of saying the session ended.
            await self.accept()
            await self.close(code=CLOSE_UNAUTHORIZED)
            return
        if not await database_sync_to_async(may_read)(user):
            await self.accept()
            await self.close(code=CLOSE_NO_ROLE)
            return
        self.group = self.group_for(self.scope["url_route"]["kwargs"])
        self.outbox: asyncio.Queue = asyncio.Queue(maxsize=SOCKET_QUEUE_FRAMES)
        self.sender = asyncio.create_task(self._send_loop())
        await self.channel_layer.group_add(self.group, self.channel_name)
        await database_sync_to_async(interest_register)(self.group)
        self.renewer = asyncio.create_task(self._renew_interest())
        await self.accept()

    async def _renew_interest(self) -> None:
        while True:
            await asyncio.sleep(INTEREST_TTL_S / 3)
            await database_sync_to_async(interest_register)(self.group)

    def group_for(self, kwargs: dict) -> str:
        return TIMELINE_GROUP

    async def disconnect(self, code: int) -> None:
        if hasattr(self, "sender"):
            self.sender.cancel()
            self.renewer.cancel()
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def a2a_events(self, message: dict) -> None:
        try:
            self.outbox.put_nowait(message["events"])
        except asyncio.QueueFull:
            log.warning("closing a WebSocket that fell %d frames behind", SOCKET_QUEUE_FRAMES)
            self.sender.cancel()
            await self.close(code=CLOSE_TOO_SLOW)

    async def _send_loop(self) -> None:
        while True:
            events = await self.outbox.get()
            await self.send_json({"events": events})

    async def receive_json(self, content, **kwargs) -> None:
        """The stream is one-way; anything a client sends is ignored."""


class ScopedStreamConsumer(EventStreamConsumer):
    """Events of one conversation, scene group or session."""

    def group_for(self, kwargs: dict) -> str:
        builders = {"conversation": conversation_group, "scene": scene_group,
                    "session": session_group}
        return builders[kwargs["kind"]](kwargs["key"])


class SkillProgressConsumer(EventStreamConsumer):
    """Events that belong to no conversation, scene group or session."""

    def group_for(self, kwargs: dict) -> str:
        return SKILL_PROGRESS_GROUP
