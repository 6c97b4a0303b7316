"""Events leave after commit, keep their names, and reach the right groups and sockets."""

from __future__ import annotations

import asyncio
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.db import transaction
from django.test import Client

from messages import events
from messages.events import (
    EVENT_FAILED,
    EVENT_MESSAGE,
    INTEREST_CACHE_S,
    SKILL_PROGRESS_GROUP,
    TIMELINE_GROUP,
    conversation_group,
    interest_cached,
    interest_in,
    interest_register,
    publisher,
)
from messages.outbound import SendRequest, message_send
from reachconsole.asgi import application
from tests.conftest import reader

pytestmark = pytest.mark.django_db(transaction=True)
XSS = '<img src=x onerror="window.pwned=1">'


@pytest.fixture
def bound_loop():
    yield
    publisher.bind_loop(None)


def run(coro_fn):
    return async_to_sync(coro_fn)()


async def _listen(*groups: str) -> str:
    """Join groups the way a socket does: the group, and the interest the publisher reads."""
    layer = get_channel_layer()
    publisher.bind_loop(asyncio.get_running_loop())
    channel = await layer.new_channel()
    for group in groups:
        await layer.group_add(group, channel)
        await sync_to_async(interest_register)(group)
        # Redis pub/sub subscribes asynchronously: a probe that comes back proves the
        # subscription is live before the test sends what it means to receive.
        await layer.group_send(group, {"type": "probe"})
        assert (await asyncio.wait_for(layer.receive(channel), 5))["type"] == "probe"
    return channel


def test_events_leave_after_commit_and_never_on_rollback(bound_loop):
    def send_and_roll_back():
        with pytest.raises(RuntimeError), transaction.atomic():
            message_send(request=SendRequest(to="fin.gone", conversation_id="c-1"))
            raise RuntimeError("rolled back")

    def send():
        return message_send(request=SendRequest(to="fin.gone", conversation_id="c-1"))

    async def scenario():
        layer = get_channel_layer()
        channel = await _listen(TIMELINE_GROUP, conversation_group("c-1"))
        await sync_to_async(send_and_roll_back)()
        # The same receive stays pending across the check: the pub/sub layer unsubscribes a
        # channel whose receive is cancelled, and would miss what the commit sends next.
        first = asyncio.ensure_future(layer.receive(channel))
        done, _ = await asyncio.wait({first}, timeout=0.5)
        assert not done, "an event left for a rolled-back change"
        row = await sync_to_async(send)()
        frames = [await asyncio.wait_for(first, 5),
                  await asyncio.wait_for(layer.receive(channel), 5)]
        return row, frames

    row, frames = run(scenario)
    for frame in frames:  # one frame for the timeline, one for the conversation
        assert frame["type"] == "a2a.events"
        names = [e["event"] for e in frame["events"]]
        # SENT, then UNDELIVERABLE with its failure twin, in one frame
        assert names == [EVENT_MESSAGE, EVENT_MESSAGE, EVENT_FAILED]
        assert frame["events"][-1]["messageId"] == row.message_id
        assert frame["events"][-1]["status"] == "UNDELIVERABLE"
        assert "no agent fin.gone" in frame["events"][-1]["error"]


def test_an_event_without_a_scope_goes_to_skill_progress(bound_loop):
    async def scenario():
        layer = get_channel_layer()
        channel = await _listen(SKILL_PROGRESS_GROUP)
        await sync_to_async(message_send)(request=SendRequest(to="fin.gone"))
        return await asyncio.wait_for(layer.receive(channel), 5)

    frame = run(scenario)
    assert {e["event"] for e in frame["events"]} == {EVENT_MESSAGE, EVENT_FAILED}


def _session_cookie(user: User) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


def test_the_timeline_socket_forwards_frames_with_event_names(bound_loop):
    user = reader("ops", password="pw-ops-12345")
    cookie = _session_cookie(user)

    async def scenario():
        publisher.bind_loop(asyncio.get_running_loop())
        ws = WebsocketCommunicator(application, "/ws/timeline/", headers=[
            (b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1"),
            (b"cookie", f"sessionid={cookie}".encode()),
        ])
        connected, _ = await ws.connect()
        assert connected
        try:
            await database_sync_to_async(message_send)(
                request=SendRequest(to="fin.gone", payload={"note": XSS}))
            return await ws.receive_json_from(timeout=5)
        finally:
            await ws.disconnect()

    frame = run(scenario)
    assert [e["event"] for e in frame["events"]] == [EVENT_MESSAGE, EVENT_MESSAGE, EVENT_FAILED]
    assert frame["events"][0]["status"] == "SENT"


def test_the_socket_refuses_anonymous_users_and_foreign_origins():
    user = reader("ops", password="pw-ops-12345")
    cookie = _session_cookie(user)

    async def attempt(headers):
        ws = WebsocketCommunicator(application, "/ws/timeline/", headers=headers)
        connected, code = await ws.connect()
        await ws.disconnect()
        return connected, code

    async def anonymous_attempt():
        # Accepted, then closed with 4401: a browser sees the code (a refused handshake
        # would reach it as 1006, indistinguishable from a network failure).
        ws = WebsocketCommunicator(application, "/ws/timeline/", headers=[
            (b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")])
        connected, _ = await ws.connect()
        closing = await ws.receive_output(timeout=5)
        await ws.disconnect()
        return connected, closing.get("code")

    async def foreign_attempt():
        return await attempt([(b"origin", b"http://evil.example"), (b"host", b"127.0.0.1"),
                              (b"cookie", f"sessionid={cookie}".encode())])

    async def no_role_attempt():
        # Signed in, but in no group: it may not read the console, streams included.
        nobody = await database_sync_to_async(User.objects.create_user)(
            "nora", password="pw-nora-123")
        ws = WebsocketCommunicator(application, "/ws/timeline/", headers=[
            (b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1"),
            (b"cookie", f"sessionid={await database_sync_to_async(_session_cookie)(nobody)}"
                        .encode())])
        connected, _ = await ws.connect()
        closing = await ws.receive_output(timeout=5)
        await ws.disconnect()
        return connected, closing.get("code")

    anonymous = run(anonymous_attempt)
    foreign = run(foreign_attempt)
    assert anonymous == (True, 4401)
    assert foreign[0] is False
    assert run(no_role_attempt) == (True, 4403)


def test_a_conversation_nobody_listens_to_gets_no_frame(bound_loop):
    """Frames go to the timeline always, to a conversation only while a socket listens."""
    async def scenario():
        layer = get_channel_layer()
        channel = await _listen(TIMELINE_GROUP)
        quiet = await layer.new_channel()
        await layer.group_add(conversation_group("c-quiet"), quiet)  # joined, not registered
        await sync_to_async(message_send)(
            request=SendRequest(to="fin.gone", conversation_id="c-quiet"))
        frame = await asyncio.wait_for(layer.receive(channel), 5)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(layer.receive(quiet), 0.5)
        return frame

    frame = run(scenario)
    assert frame["events"][-1]["event"] == EVENT_FAILED
    assert interest_in([conversation_group("c-quiet")]) == set()


def test_interest_is_answered_from_memory_only_while_fresh():
    """The publisher skips the thread hop and the cache read when this process knows the
    answer; an unknown or aged answer sends it to the cache."""
    listened, quiet = conversation_group("c-heard-here"), conversation_group("c-quiet-here")
    interest_register(listened)
    assert interest_cached([listened, quiet]) is None
    assert interest_in([listened, quiet]) == {listened}
    assert interest_cached([listened, quiet]) == {listened}
    assert interest_cached([quiet]) == set()
    events._interest_cache[listened] = (time.monotonic() - INTEREST_CACHE_S, True)
    assert interest_cached([listened, quiet]) is None
