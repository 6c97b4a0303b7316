"""`POST /api/a2a/send` with `wait: true` holds neither a database connection nor a thread
while it waits (messages/waits.py, reachconsole/core/idle.py).

Each waiter used to keep one of the process's pooled connections and one thread for up to
`timeoutMs`: nine waiters made every other call 503 once the pool's timeout passed, and two
hundred added two hundred threads to Daphne. Speed under that load is bench/waiters.py's
business; these tests check that waiters hold nothing, that others are served meanwhile and
that every waiter gets its answer or its 202.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.conf import settings
from django.core.cache import cache
from django.db import transaction

from messages import events, protocol, waits
from messages.api import _task_outcome
from messages.events import publisher
from messages.inbound import Incoming, messages_ingest
from messages.models import Message, Status
from messages.outbound import SendRequest, message_send
from messages.sweeps import deliveries_sweep
from tests.conftest import TOKEN, acked, published, register
from tests.processes import HOST, daphne_process

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("console_hears")]
MT = protocol.MessageType
HEADERS = {"Authorization": f"Bearer {TOKEN}", "X-OODER-Source": "studio",
           "Content-Type": "application/json"}
WAITERS = 60
WAIT_MS = 6000
LONG_LEASE = (600_000, 300_000)  # lease TTL and heartbeat, ms
LONG_LEASE_ENV = {"REACH_LEASE_TTL_MS": "600000", "REACH_HEARTBEAT_MS": "300000"}


@pytest.fixture
def bound_loop(monkeypatch):
    # No answer about who listens kept from an earlier test.
    monkeypatch.setattr(events, "_interest_cache", {})
    yield
    publisher.bind_loop(None)


async def _listening(hub: waits.AnswerWaits) -> None:
    """Until pushes reach `hub` and the publishers can know that it listens."""
    await asyncio.wait_for(hub.live.wait(), 10)
    key = events.INTEREST_PREFIX + waits.ANSWERS_GROUP
    for _ in range(200):
        if await sync_to_async(cache.get)(key):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the listener did not register its interest")


def sent_out(row: Message) -> None:
    """The broker's PUBACK for `row`, recorded as the bridge records it."""
    with transaction.atomic():
        published(row, row.created_at)


def answered(row: Message) -> None:
    """The node's TASK_RESPONSE for `row`, ingested as the bridge ingests it."""
    prefix = settings.MQTT_TOPIC_PREFIX
    response = protocol.new_envelope(
        message_type=MT.TASK_RESPONSE, from_agent_id=row.to_agent_id,
        to_agent_id=row.from_agent_id or "console",
        headers={"inReplyTo": row.message_id, "originNodeId": row.target_node_id,
                 "replyNodeId": row.target_node_id},
        payload={"ok": True, "result": {"answer": 42}})
    topic = protocol.inbox_topic(prefix, settings.REACH_NODE_ID)
    messages_ingest(batch=[Incoming(topic, protocol.encode(response))],
                    node_id=settings.REACH_NODE_ID, prefix=prefix)


@pytest.fixture
def pushes_only(bound_loop, monkeypatch):
    """A waiter's own reads pushed past the test's end: only a push can wake it."""
    monkeypatch.setattr(waits, "EARLY_CHECKS_S", ())
    monkeypatch.setattr(waits, "CHECK_EVERY_S", 600.0)
    monkeypatch.setattr(waits, "CHECK_DEAF_S", 600.0)
    register("wait.fin", "node-w")


def waiting_for(task_id: str, hub: waits.AnswerWaits, reads: list, then) -> tuple[int, dict]:
    """Send a task and wait for it on `hub`, counting its reads; once pushes reach the hub,
    `then(row)` (in a thread) makes something happen. Returns the wait's outcome."""
    row = message_send(request=SendRequest(to="wait.fin", task_id=task_id))
    sent_out(row)

    async def check():
        reads.append(time.monotonic())
        return await sync_to_async(_task_outcome)(row.message_id)

    async def scenario():
        publisher.bind_loop(asyncio.get_running_loop())
        waiting = asyncio.create_task(hub.wait(task_id, timeout_s=120, check=check))
        await asyncio.sleep(0)
        await _listening(hub)
        assert not waiting.done()
        await then(row, waiting)
        return await asyncio.wait_for(waiting, 60)

    return async_to_sync(scenario)()


def test_a_waiter_is_woken_by_its_tasks_end_not_by_reading_again(pushes_only):
    hub, reads = waits.AnswerWaits(), []

    async def answer(row, waiting):
        await sync_to_async(answered)(row)

    code, outcome = waiting_for("t-woken", hub, reads, answer)
    assert code == 200 and outcome["status"] == Status.COMPLETED, outcome
    assert outcome["response"] == {"ok": True, "result": {"answer": 42}}
    assert hub.woken >= 1 and hub.pushes >= 1
    assert len(reads) == 1 + hub.woken  # the first read, then one per push for its task


def test_a_push_for_another_task_wakes_nobody(pushes_only):
    other = message_send(request=SendRequest(to="wait.fin", task_id="t-other"))
    sent_out(other)
    hub, reads = waits.AnswerWaits(), []

    async def other_then_mine(row, waiting):
        await sync_to_async(answered)(other)
        while hub.pushes == 0:  # the other task's end reached this process...
            await asyncio.sleep(0.05)
        assert not waiting.done() and hub.woken == 0 and len(reads) == 1  # ...woke nobody
        await sync_to_async(answered)(row)

    code, outcome = waiting_for("t-mine", hub, reads, other_then_mine)
    assert code == 200 and outcome["status"] == Status.COMPLETED and hub.woken == 1


def _threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def _post(port: int, body: dict, timeout: float) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("POST", "/api/a2a/send", body=json.dumps(body), headers=HEADERS)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    try:
        conn.request("GET", path, headers=HEADERS)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_waiters_hold_no_connection_and_no_thread_and_others_are_served(tmp_path, settings):
    """60 waiters on an agent that never answers, in a stock Daphne whose pool has 4
    connections and gives up on a request after 2 s: before, the fifth waiter took the
    last connection and every other call answered 503."""
    # Leases that outlast the test however slow the machine: a send must not find its
    # agent stale (two heartbeats missed) because setting up sixty waiters took a while.
    settings.REACH_LEASE_TTL_MS, settings.REACH_HEARTBEAT_MS = LONG_LEASE
    register("wait.slow", "node-slow")
    register("wait.other", "node-slow")
    with daphne_process(tmp_path, REACH_DB_POOL_MAX="4", REACH_DB_POOL_TIMEOUT_S="2",
                        **LONG_LEASE_ENV) as (
            port, log_path, proc):
        assert _get(port, "/api/roster/agents") == 200
        idle_threads = _threads(proc.pid)
        results: list[tuple[int, dict]] = []
        lock = threading.Lock()

        def waiter(i: int) -> None:
            out = _post(port, {"to": "wait.slow", "wait": True, "timeoutMs": WAIT_MS,
                               "taskId": f"t-wait-{i}"}, timeout=WAIT_MS / 1000 + 60)
            with lock:
                results.append(out)

        threads = [threading.Thread(target=waiter, args=(i,), daemon=True)
                   for i in range(WAITERS)]
        for thread in threads:
            thread.start()
        # Every waiter's send is stored (SENT: no worker runs here) before reading on.
        deadline = time.monotonic() + 60
        while (Message.objects.filter(task_id__startswith="t-wait-").count() < WAITERS
               and time.monotonic() < deadline):
            time.sleep(0.1)
        assert Message.objects.filter(task_id__startswith="t-wait-").count() == WAITERS
        time.sleep(waits.EARLY_CHECKS_S[-1] + 1)  # past their first second's reads
        waiting_threads = _threads(proc.pid)
        reads = Counter(_get(port, path) for _ in range(10)
                        for path in ("/api/roster/agents", "/api/a2a/tasks?limit=5"))
        # Others can still send while they wait, and a send without `wait` returns at once.
        status, body = _post(port, {"to": "wait.other"}, timeout=30)
        for thread in threads:
            thread.join(WAIT_MS / 1000 + 90)
        assert not any(thread.is_alive() for thread in threads), "a waiter hung"
        log = log_path.read_text()

    assert reads == Counter({200: 20}), (reads, log[-3000:])
    assert status == 202 and body["status"] == Status.SENT, body
    # A thread per waiter before; now what Daphne's loop shares (the executor's few).
    assert waiting_threads <= idle_threads + 8, (idle_threads, waiting_threads)
    statuses = Counter(code for code, _ in results)
    assert statuses == Counter({202: WAITERS}), (statuses, log[-3000:])
    assert all(out["status"] == Status.SENT and "did not arrive in time" in out["detail"]
               for _, out in results)
    assert "connections, 0 idle" not in log and "Traceback" not in log, log[-3000:]


def test_a_waiter_in_daphne_gets_the_answer_that_arrives_while_it_waits(tmp_path, settings):
    """The answer comes in through another process (here the test's, as a worker's bridge
    would store it): pushed where Redis carries the stream, read where it does not."""
    settings.REACH_LEASE_TTL_MS, settings.REACH_HEARTBEAT_MS = LONG_LEASE
    register("wait.fin", "node-w")
    with daphne_process(tmp_path, **LONG_LEASE_ENV) as (port, log_path, _proc):
        result: list[tuple[int, dict]] = []
        thread = threading.Thread(target=lambda: result.append(_post(
            port, {"to": "wait.fin", "wait": True, "timeoutMs": 60000, "taskId": "t-daphne"},
            timeout=120)), daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while (not Message.objects.filter(task_id="t-daphne").exists()
               and time.monotonic() < deadline):
            time.sleep(0.05)
        row = Message.objects.get(task_id="t-daphne")
        sent_out(row)
        answered(row)
        thread.join(90)
        log = log_path.read_text()
    assert result, log[-3000:]
    status, body = result[0]
    assert status == 200, (body, log[-3000:])
    assert body["status"] == Status.COMPLETED
    assert body["response"] == {"ok": True, "result": {"answer": 42}}


def test_a_wait_whose_task_expires_first_is_a_202_with_the_words(api):
    """The task's own deadline ended it while the caller waited: that is running out of
    time (the executor may be working on it still), not an answer, so 202, not 200."""
    register("wait.late", "node-late")

    def expire_once_acknowledged() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            row = Message.objects.filter(task_id="t-late").first()
            if row is not None:
                sent_out(row)
                with transaction.atomic():
                    acked(row, row.created_at)
                row.refresh_from_db()
                # As beat's sweep does once the deadline has passed.
                deliveries_sweep(now=row.deadline_at + timedelta(milliseconds=1))
                return
            time.sleep(0.05)

    helper = threading.Thread(target=expire_once_acknowledged, daemon=True)
    helper.start()
    r = api.post("/api/a2a/send", {"to": "wait.late", "wait": True, "timeoutMs": 20000,
                                   "taskId": "t-late"})
    helper.join(30)
    assert r.status_code == 202, r.content
    body = r.json()
    assert body["status"] == Status.EXPIRED, body
    assert body["error"] == "acknowledged, no response within 20000 ms"
    assert body["detail"] == (
        "the response did not arrive in time; the task may have been accepted — query "
        f"GET /api/a2a/messages/{body['messageId']} later")
