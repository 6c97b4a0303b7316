"""Two of everything: the console as it scales out, started by the test (README "Scaling out").

Two Daphnes, two Celery workers (each with its own bridge: REACH_BRIDGE_INSTANCE 1 and 2)
and beats, on a private PostgreSQL, Redis and Mosquitto (MQTT 5) from tests/stack.py:

- the bridges share the inbound topics (`$share/…`): N messages from a node are N rows, and
  both bridges stored some (`reach_bridge_ingested_total{instance}`);
- an event one worker ingests reaches a WebSocket on either Daphne (Redis channel layer);
- a send taken by Daphne A is published by whichever bridge claims it, executed once;
- two beats at once change nothing twice (one EXPIRED history row per lapsed lease, one
  attempt per attempt number, one final transition per message);
- a bridge killed (SIGKILL) mid-burst and started again loses nothing: Mosquitto keeps
  the killed session's share (what it had not acknowledged, and its round-robin turns while
  it was down) and hands it to that session when it comes back, not to the other member;
- with MQTT 3.1.1 (no shared subscriptions) one bridge ingests, the other stands by, and the
  standby takes over when the active one is killed.

Slow (a minute or two), and meaningless in the embedded mode (one process): it runs only
with real services (REACH_EXPECT_REAL_SERVICES=1, CI's second run) or REACH_FAULT_RUNS=1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from messages import protocol
from tests.conftest import expect_real_services
from tests.fakenode import FakeNode
from tests.mqtt import free_port
from tests.stack import (
    HOST,
    ROOT,
    Stack,
    StackError,
    _port_open,
    _wait,
    bridge_client_id,
    find_binaries,
)

ENABLED = expect_real_services() or os.environ.get("REACH_FAULT_RUNS") == "1"
pytestmark = [
    pytest.mark.skipif(not ENABLED, reason=(
        "the two-by-two topology needs real services: it starts a private PostgreSQL, Redis "
        "and Mosquitto (MQTT 5) and two Daphnes, two workers and beats; the embedded mode is "
        "one process with nothing to share. Set REACH_EXPECT_REAL_SERVICES=1 (CI's second "
        "run) or REACH_FAULT_RUNS=1")),
    pytest.mark.timeout(900),
]

MT = protocol.MessageType
EXTRA = ("daphne2", "worker2", "beat2")
SILENT_NODE = "node-silent"


class TwoByTwo(Stack):
    """tests/stack.py's console plus a second Daphne, a second worker (bridge instance 2),
    and on demand a second beat. The first of each is the stack's own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.http_port2 = free_port()

    @property
    def base_url2(self) -> str:
        return f"http://{HOST}:{self.http_port2}"

    def log_paths(self):
        paths = super().log_paths()
        paths.update({n: self.log_path(n) for n in EXTRA if self.log_path(n).exists()})
        return paths

    def _app_argv(self, name: str) -> list[str]:
        if name == "daphne2":
            return [self.bins["daphne"], "-b", HOST, "-p", str(self.http_port2),
                    "reachconsole.asgi:application"]
        if name == "worker2":
            return [self.bins["celery"], "-A", "reachconsole", "worker", "-l", "info",
                    "-n", "worker2@%h"]
        if name == "beat2":
            return [self.bins["celery"], "-A", "reachconsole", "beat", "-l", "info",
                    "--schedule", str(self.run_dir / "beat2-schedule")]
        return super()._app_argv(name)

    def _start_app(self, name: str, wait: bool = True) -> None:
        if name not in EXTRA:
            super()._start_app(name, wait)
            return
        offset = self.log_path(name).stat().st_size if self.log_path(name).exists() else 0
        self._spawn(name, self._app_argv(name),
                    env={**self.env(), "REACH_BRIDGE_INSTANCE": "2"})
        proc = self.procs[name]

        def up() -> bool:
            if proc.poll() is not None:
                raise StackError(f"{name} exited with {proc.returncode}:\n"
                                 f"{self.tail(name, 60, {name: offset})}")
            if name == "daphne2":
                return _port_open(self.http_port2)
            if name == "worker2":
                return " ready." in self.log_text(name, {name: offset})
            # As the stack's own beat: its first line may go through LOGGING, not stdout.
            return "beat: Starting" in self.log_text(name, {name: offset}) or (
                time.monotonic() - started > 3)

        started = time.monotonic()
        if wait:
            _wait(up, 90, f"{name} did not come up")

    def start(self, name: str | None = None) -> Stack:
        if name in EXTRA:
            self._start_app(name)
            return self
        return super().start(name)

    def new_run(self) -> str:
        for name in EXTRA:
            self._terminate(name)
        prefix = super().new_run()
        for name in ("daphne2", "worker2"):
            self._start_app(name)
        return prefix

    def stop(self) -> None:
        for name in EXTRA:
            try:
                self._terminate(name)
            except Exception as exc:  # go on: the rest must stop too
                print(f"stack: stopping {name} failed: {exc}", file=sys.stderr)
        super().stop()


@pytest.fixture(scope="module")
def stack() -> Iterator[TwoByTwo]:
    _, missing = find_binaries()
    if missing:
        pytest.fail("the topology test needs PostgreSQL, Redis and Mosquitto binaries; "
                    "missing: " + ", ".join(missing))
    # Short leases and sweeps: the two-beats test watches leases lapse within seconds.
    running = TwoByTwo(extra_env={
        "REACH_LEASE_TTL_MS": "3000", "REACH_HEARTBEAT_MS": "1000", "REACH_LEASE_SWEEP_S": "0.5",
        "REACH_ACK_TIMEOUT_MS": "500", "REACH_RETRY_MAX_ATTEMPTS": "3",
        "REACH_LOG_LEVEL": "INFO"})
    try:
        running.start()
    except BaseException:
        print(running.tails(60), file=sys.stderr)
        running.keep_dir = True
        running.stop()
        raise
    try:
        yield running
    finally:
        running.stop()


# --- tools --------------------------------------------------------------------------------------
def _sql(stack: Stack, query: str, params: tuple = ()) -> list[tuple]:
    with stack.connect_db() as conn:
        return conn.execute(query, params).fetchall()


def _stored(stack: Stack, ids: list[str]) -> tuple[int, int]:
    """(rows with these message ids, distinct ids among them)."""
    (row,) = _sql(stack, "SELECT count(*), count(DISTINCT message_id) FROM a2a_message "
                         "WHERE message_id = ANY(%s)", (ids,))
    return row


def _ingested(stack: Stack) -> dict[str, float]:
    """reach_bridge_ingested_total by bridge instance, from /metrics."""
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^reach_bridge_ingested_total\{instance="([^"]+)"\} (\S+)$', text, re.M)}


class Publisher:
    """A plain MQTT 5 client publishing as a node would (QoS 1, waiting for each PUBACK)."""

    def __init__(self, stack: Stack):
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.connect(HOST, stack.mqtt_port)
        self.client.loop_start()
        self.topic = protocol.inbox_topic(stack.prefix, "node-z")

    def burst(self, n: int, *, tag: str, on: dict | None = None) -> list[str]:
        """Publish `n` EVENTs from node-y to node-z (observed traffic); `on` maps an index to
        a callable run right after that message."""
        ids = []
        for i in range(n):
            env = protocol.new_envelope(message_type=MT.EVENT, from_agent_id="fin.tax",
                                        to_agent_id="llm.chat", payload={"tag": tag, "n": i},
                                        headers={"originNodeId": "node-y"})
            ids.append(env.message_id)
            self.client.publish(self.topic, protocol.encode(env), qos=1).wait_for_publish(10)
            if on and i in on:
                on[i]()
        return ids

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@pytest.fixture
def publisher(stack) -> Iterator[Publisher]:
    pub = Publisher(stack)
    yield pub
    pub.close()


def _all_stored(stack: Stack, ids: list[str], timeout: float = 90) -> tuple[int, int]:
    def done():
        rows, distinct = _stored(stack, ids)
        return (rows, distinct) if rows >= len(ids) else None

    try:
        return _wait(done, timeout, f"all {len(ids)} messages stored", interval=0.5)
    except StackError:
        print(stack.tails(40), file=sys.stderr)
        return _stored(stack, ids)


# --- the tests ----------------------------------------------------------------------------------
def test_it_runs_two_bridges_that_share_the_inbound_topics(stack):
    for name in ("worker", "worker2"):
        _wait(lambda name=name: "MQTT ingest: shared" in stack.log_text(name), 30,
              f"{name} saying it ingests through shared subscriptions")
    text = stack.log_text("worker") + stack.log_text("worker2")
    assert "one active bridge" not in text


def test_n_messages_from_a_node_are_n_rows_and_both_bridges_stored_some(stack, publisher):
    before = _ingested(stack)
    ids = publisher.burst(2000, tag="share")
    rows, distinct = _all_stored(stack, ids)
    assert (rows, distinct) == (2000, 2000)

    def split():
        after = _ingested(stack)
        got = {i: after.get(i, 0) - before.get(i, 0)
               for i in (bridge_client_id("1"), bridge_client_id("2"))}
        return got if sum(got.values()) >= 2000 else None

    got = _wait(split, 15, "the bridges' counters flushed")
    assert got[bridge_client_id("1")] > 0 and got[bridge_client_id("2")] > 0, got
    # Each message stored by one bridge: the counts add up to the burst, not twice it.
    assert sum(got.values()) == 2000, got


def _login_cookie(stack: Stack) -> str:
    """A signed-in session in the stack's database (its processes all read it)."""
    code = ("from django.contrib.auth.models import Group, User;"
            "from django.test import Client;"
            "u = User.objects.create_user('topo-' + __import__('uuid').uuid4().hex[:6], "
            "password='pw-topology-12345');"
            "u.groups.add(Group.objects.get(name='viewer'));"
            "c = Client(); c.force_login(u); print('SESSION', c.cookies['sessionid'].value)")
    result = subprocess.run([sys.executable, "manage.py", "shell", "-c", code], cwd=ROOT,
                            env=stack.env(), capture_output=True, text=True, timeout=60)
    match = re.search(r"SESSION (\S+)", result.stdout)
    assert match, f"could not make a session: {result.stdout}\n{result.stderr}"
    return match.group(1)


class Socket:
    """A signed-in browser's timeline WebSocket, collecting the message ids of its events."""

    def __init__(self, port: int, cookie: str):
        from websockets.sync.client import connect

        self.ws = connect(f"ws://{HOST}:{port}/ws/timeline/", open_timeout=10,
                          additional_headers={"Cookie": f"sessionid={cookie}",
                                              "Origin": f"http://{HOST}:{port}"})
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        while not self._stop.is_set():
            try:
                frame = json.loads(self.ws.recv(timeout=0.5))
            except TimeoutError:
                continue
            except ConnectionClosed:
                return
            for event in frame.get("events", []):
                if event.get("event") == "a2a_message" and event.get("messageId"):
                    self.seen.add(event["messageId"])

    def close(self) -> None:
        self._stop.set()
        self.ws.close()
        self._thread.join(5)


def test_an_event_either_worker_ingests_reaches_a_socket_on_either_daphne(stack, publisher):
    cookie = _login_cookie(stack)
    sockets = [Socket(stack.http_port, cookie), Socket(stack.http_port2, cookie)]
    try:
        time.sleep(1)  # the sockets have joined their groups
        before = _ingested(stack)
        ids = publisher.burst(200, tag="events")
        assert _all_stored(stack, ids) == (200, 200)
        for sock, daphne in zip(sockets, ("daphne", "daphne2"), strict=True):
            _wait(lambda sock=sock: set(ids) <= sock.seen, 30,
                  f"every event on the socket of {daphne} "
                  f"({len(set(ids) & sock.seen)} of {len(ids)} so far)")
        after = _wait(lambda: (a := _ingested(stack)) and sum(a.values()) - sum(
            before.values()) >= 200 and a, 15, "the bridges' counters flushed")
        # Both workers stored some of these: events from each crossed to both Daphnes.
        for instance in (bridge_client_id("1"), bridge_client_id("2")):
            assert after.get(instance, 0) > before.get(instance, 0), (instance, before, after)
    finally:
        for sock in sockets:
            sock.close()


def _post(base_url: str, token: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{base_url}{path}", data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {token}", "X-OODER-Source": "studio",
                 "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read()[:500].decode(errors="replace")}


def _get(base_url: str, token: str, path: str, params: dict) -> tuple[int, Any]:
    query = urllib.parse.urlencode(params, doseq=True)
    request = urllib.request.Request(
        f"{base_url}{path}{'?' + query if query else ''}",
        headers={"Authorization": f"Bearer {token}", "X-OODER-Source": "studio"})
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read()[:500].decode(errors="replace")}


def test_sends_taken_by_one_daphne_are_published_by_a_bridge_and_run_once(stack):
    node = FakeNode(base_url=stack.base_url2, token=stack.token, mqtt_host=HOST,
                    mqtt_port=stack.mqtt_port, prefix=stack.prefix, node_id="node-t",
                    agents=["topo.worker"], work_s=0.01, heartbeat_s=0.5)
    node.start()
    try:
        task_ids = [f"topo-{uuid.uuid4().hex[:10]}" for _ in range(40)]
        for task_id in task_ids:
            status, body = _post(stack.base_url, stack.token, "/api/a2a/send",
                                 {"to": "topo.worker", "taskId": task_id,
                                  "payload": {"q": task_id}, "timeoutMs": 60000})
            assert status in (200, 201, 202), body

        def finished():
            rows = _sql(stack, "SELECT task_id, status FROM a2a_message WHERE task_id = ANY(%s) "
                               "AND direction = 'SEND' AND message_type = 'TASK_REQUEST'",
                        (task_ids,))
            done = [r for r in rows if r[1] == "COMPLETED"]
            return rows if len(done) == len(task_ids) else None

        rows = _wait(finished, 60, "every task completed")
        assert len(rows) == len(task_ids)  # one attempt each: nothing was sent twice
        assert node.executed_twice() == {}
        assert sum(node.executions_by_task[t] for t in task_ids) == len(task_ids)
        # The task list and the numbers, kept by whichever bridge wrote the rows, read on
        # the other Daphne.
        status, tasks = _get(stack.base_url2, stack.token, "/api/a2a/tasks",
                             {"agent": "topo.worker", "limit": 100})
        assert status == 200
        ours = [t for t in tasks if t["taskId"] in task_ids]
        assert len(ours) == len(task_ids)
        assert {(t["status"], t["attempts"], t["answeredBy"]) for t in ours} == {
            ("COMPLETED", 1, "node-t")}
        status, stats = _get(stack.base_url, stack.token, "/api/ops/agents/topo.worker/stats",
                             {"window": "5m"})
        assert status == 200
        assert (stats["tasks"], stats["completed"], stats["answered"]) == (
            len(task_ids), len(task_ids), len(task_ids))
        assert stats["successRate"] == 1.0 and stats["sentToAnsweredMs"]["p95"] is not None
    finally:
        node.stop()


def test_a_cancel_on_one_daphne_ends_the_task_and_tells_its_node(stack):
    # A node that takes its time: the task is on the bus (ACKED) when it is canceled.
    node = FakeNode(base_url=stack.base_url, token=stack.token, mqtt_host=HOST,
                    mqtt_port=stack.mqtt_port, prefix=stack.prefix, node_id="node-slow",
                    agents=["topo.slow"], work_s=3.0, heartbeat_s=0.5)
    node.start()
    try:
        task_id = f"topo-cancel-{uuid.uuid4().hex[:8]}"
        status, body = _post(stack.base_url, stack.token, "/api/a2a/send",
                             {"to": "topo.slow", "taskId": task_id, "timeoutMs": 60000})
        assert status == 202, body

        def acked():
            rows = _sql(stack, "SELECT status FROM a2a_message WHERE task_id = %s "
                               "AND message_type = 'TASK_REQUEST'", (task_id,))
            return rows if rows and rows[0][0] == "ACKED" else None

        _wait(acked, 30, "the task acknowledged by its node")
        status, body = _post(stack.base_url2, stack.token, f"/api/a2a/tasks/{task_id}/cancel",
                             {"reason": "topology drill"})
        assert status == 200, body
        assert body["status"] == "CANCELED" and body["cancelSentTo"] == ["node-slow"]
        _wait(lambda: node.canceled == [task_id] or None, 30, "the node told with CANCEL")

        def answered_late():
            rows = _sql(stack, "SELECT count(*) FROM a2a_message r JOIN a2a_message q "
                               "ON r.in_reply_to = q.message_id WHERE q.task_id = %s "
                               "AND r.message_type = 'TASK_RESPONSE'", (task_id,))
            return rows[0][0] or None

        _wait(answered_late, 30, "the node's late response recorded")
        (row,) = _sql(stack, "SELECT status, error FROM a2a_message WHERE task_id = %s "
                             "AND message_type = 'TASK_REQUEST'", (task_id,))
        assert row[0] == "CANCELED" and row[1].endswith(": topology drill")
        status, task = _get(stack.base_url, stack.token, f"/api/a2a/tasks/{task_id}", {})
        assert status == 200 and task["status"] == "CANCELED"
        kinds = [m["messageType"] for m in task["messages"]]
        assert {"TASK_REQUEST", "CANCEL", "TASK_RESPONSE"} <= set(kinds)
        status, again = _post(stack.base_url, stack.token, f"/api/a2a/tasks/{task_id}/cancel",
                              {})
        assert status == 409
    finally:
        node.stop()


def test_a_silent_node_raises_one_alarm_with_its_children_and_it_clears(stack):
    """Beat's alarm evaluation in production shape: a node that stops heartbeating goes
    DOWN, raising one node_down alarm with the capability only it offered as its child, once
    however many evaluations run; the node back clears both, into the history."""
    def make_node() -> FakeNode:
        return FakeNode(base_url=stack.base_url, token=stack.token, mqtt_host=HOST,
                        mqtt_port=stack.mqtt_port, prefix=stack.prefix, node_id="node-solo",
                        agents=["topo.solo"], heartbeat_s=0.5)

    def alarms(state: str = "active") -> list[dict]:
        status, body = _get(stack.base_url2, stack.token, "/api/ops/alarms", {"state": state})
        assert status == 200, body
        return [a for a in body if a["subject"] in ("node-solo", "solo")]

    def heard() -> bool:
        status, nodes = _get(stack.base_url, stack.token, "/api/cluster/nodes", {})
        assert status == 200, nodes
        return any(n["nodeId"] == "node-solo" and n["status"] == "ONLINE" and n["lastSeen"]
                   for n in nodes)

    node = make_node().start()
    # Its heartbeats heard (registration alone makes a node without a last-seen time).
    _wait(lambda: heard() or None, 30, "the node's heartbeats heard")
    node.stop()  # silent from here on

    def raised():
        found = alarms()
        kinds = {a["kind"] for a in found}
        return found if {"node_down", "capability_uncovered"} <= kinds else None

    try:
        found = _wait(raised, 60, "the silent node's alarm and its child")
    except StackError as exc:
        nodes = _sql(stack, "SELECT node_id, status, last_seen_at, heartbeat_ms, now() "
                            "FROM roster_clusternode")
        hearing = _sql(stack, "SELECT * FROM roster_bushearing")
        raise AssertionError(f"{exc}; nodes {nodes}; hearing {hearing}; "
                             f"alarms {alarms('all')}") from None
    time.sleep(6)  # more evaluations of beat: nothing fires twice
    found = alarms()
    (down,) = [a for a in found if a["kind"] == "node_down"]
    (child,) = [a for a in found if a["kind"] == "capability_uncovered"]
    assert down["subject"] == "node-solo" and down["parentId"] is None
    assert child["subject"] == "solo" and child["parentId"] == down["id"]

    back = make_node().start()  # heartbeats again: the node is up, its agent live
    try:
        _wait(lambda: not alarms() or None, 60, "the alarms cleared")
        history = {a["id"]: a for a in alarms("all")}
        assert history[down["id"]]["clearedAt"] and history[child["id"]]["clearedAt"]
    finally:
        back.stop()


def _beat_runs(path) -> int:
    """How often a beat has sent the lease and delivery sweeps (its schedule file)."""
    import shelve

    for _ in range(10):  # the beat may be writing it just now
        try:
            with shelve.open(str(path), flag="r") as schedule:  # noqa: S301 - our own file
                entries = schedule["entries"]
            return sum(entries[name].total_run_count
                       for name in ("leases-expire", "deliveries-sweep"))
        except Exception:  # noqa: BLE001 - read again
            time.sleep(0.2)
    return 0


def test_two_beats_at_once_change_nothing_twice(stack):
    stack.start("beat2")
    try:
        time.sleep(3)  # both beats are sending the sweeps now
        # Leases that lapse (no heartbeat after registering) and tasks to a node that never
        # answers (retried, then expired): the sweeps of both beats race for each of them.
        agents = [f"beat.a{i}" for i in range(20)]
        for agent in agents:
            status, body = _post(stack.base_url, stack.token, "/api/roster/agents",
                                 {"agentId": agent, "nodeId": SILENT_NODE})
            assert status in (200, 201), body
        task_ids = [f"beat-{uuid.uuid4().hex[:10]}" for _ in range(10)]
        for task_id in task_ids:
            status, body = _post(stack.base_url2, stack.token, "/api/a2a/send",
                                 {"to": agents[0], "targetNodeId": SILENT_NODE, "taskId": task_id,
                                  "payload": {}, "timeoutMs": 60000})
            assert status < 500, body

        def expired():
            (row,) = _sql(stack, "SELECT count(DISTINCT agent_id) FROM roster_rosterevent "
                                 "WHERE kind = 'EXPIRED' AND agent_id = ANY(%s)", (agents,))
            return row[0] == len(agents)

        _wait(expired, 30, "every lease lapsed")

        def tasks_final():
            rows = _sql(stack, "SELECT status FROM a2a_message WHERE task_id = ANY(%s) "
                               "AND message_type = 'TASK_REQUEST'", (task_ids,))
            open_ = [r for r in rows if r[0] in ("SENT", "PUBLISHED", "RETRYING", "ACKED")]
            return rows if rows and not open_ else None

        _wait(tasks_final, 60, "every task attempt final")
        time.sleep(3)  # more sweeps of both beats over the final rows
        twice = _sql(stack, "SELECT agent_id, count(*) FROM roster_rosterevent "
                            "WHERE kind = 'EXPIRED' AND agent_id = ANY(%s) "
                            "GROUP BY agent_id HAVING count(*) > 1", (agents,))
        assert twice == []
        attempts = _sql(stack, "SELECT task_id, attempt, count(*) FROM a2a_message "
                               "WHERE task_id = ANY(%s) AND message_type = 'TASK_REQUEST' "
                               "GROUP BY task_id, attempt HAVING count(*) > 1", (task_ids,))
        assert attempts == []
        transitions = _sql(
            stack, "SELECT t.message_id, t.from_status, t.to_status, count(*) "
                   "FROM a2a_transition t JOIN a2a_message m ON m.id = t.message_id "
                   "WHERE m.task_id = ANY(%s) GROUP BY 1, 2, 3 HAVING count(*) > 1",
            (task_ids,))
        assert transitions == []
        # The second beat really was sending the sweeps all along (its schedule file is
        # written when it stops), and the first one still runs.
        stack._terminate("beat2")
        assert _beat_runs(stack.run_dir / "beat2-schedule") > 20
        assert stack.procs["beat"].poll() is None
    finally:
        stack._terminate("beat2")


def test_a_bridge_killed_mid_burst_loses_nothing(stack, publisher):
    def kill():
        stack.kill("worker2")

    ids = publisher.burst(1500, tag="kill", on={500: kill})
    time.sleep(2)
    # The killed bridge's share waits in its session on the broker.
    rows, _ = _stored(stack, ids)
    assert rows < len(ids)
    stack.start("worker2")
    assert _all_stored(stack, ids) == (1500, 1500)


def _heartbeats_applied(stack: Stack) -> float:
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.search(r"^reach_heartbeats_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_every_heartbeat_reaches_a_live_bridge_whatever_the_other_does(stack, publisher):
    """A bridge that stopped keeps its persistent session; were the heartbeats a shared
    subscription, its share (QoS 0) would be lost while it is away. Each bridge hears them
    all and the first applies each: 20 heartbeats are 20 applied, with both bridges up, with
    one stopped cleanly, and with one killed."""
    topic = protocol.heartbeat_topic(stack.prefix, "node-hb")

    def beats(n: int) -> float:
        before = _heartbeats_applied(stack)
        for _ in range(n):
            env = protocol.new_envelope(message_type=MT.HEARTBEAT, from_agent_id="node-hb",
                                        headers={"originNodeId": "node-hb"},
                                        payload={"heartbeatMs": 1000, "agents": []})
            publisher.client.publish(topic, protocol.encode(env), qos=0)
            time.sleep(0.05)
        _wait(lambda: _heartbeats_applied(stack) - before >= n, 20,
              f"{n} heartbeats applied", interval=0.5)
        time.sleep(2)  # copies that would be applied twice have arrived by now
        return _heartbeats_applied(stack) - before

    try:
        assert beats(20) == 20, "both bridges up"
        stack.kill("worker2", signal.SIGTERM)  # a clean stop: its session stays
        assert beats(20) == 20, "one bridge stopped cleanly"
        offset = stack.log_offsets()
        stack.start("worker2")
        _wait(lambda: "MQTT bridge connected" in stack.log_text("worker2", offset), 30,
              "the second bridge back")
        time.sleep(1)  # subscribed
        stack.kill("worker2")  # SIGKILL
        assert beats(20) == 20, "one bridge killed"
    finally:
        if stack.procs["worker2"].poll() is not None:
            stack.start("worker2")


def test_without_shared_subscriptions_one_bridge_ingests_and_a_standby_takes_over(stack):
    """MQTT 3.1.1: the bridges say so, one holds the ingest lock; killed, the other takes
    over and what is published after is stored once."""
    stack.extra_env["MQTT_PROTOCOL"] = "3.1.1"
    try:
        since = stack.log_offsets()
        stack.new_run()
        _wait(lambda: all("one active bridge" in stack.log_text(n, since)
                          for n in ("worker", "worker2")), 30, "both bridges in single mode")

        def active() -> str | None:
            found = [n for n in ("worker", "worker2")
                     if "took the ingest lock" in stack.log_text(n, since)]
            return found[0] if len(found) == 1 else None

        holder = _wait(active, 30, "exactly one bridge holding the ingest lock")
        other = "worker2" if holder == "worker" else "worker"
        pub = Publisher(stack)
        try:
            ids = pub.burst(500, tag="single")
            assert _all_stored(stack, ids) == (500, 500)
            stack.kill(holder)
            _wait(lambda: "took the ingest lock" in stack.log_text(other, since), 30,
                  f"{other} taking over the ingest lock")
            time.sleep(1)  # its SUBSCRIBE follows the log line
            more = pub.burst(500, tag="single-after")
            assert _all_stored(stack, more) == (500, 500)
            # The killed bridge's session kept its copies: back, it stores them again as
            # no-ops, and it stands by (the survivor holds the lock).
            back = stack.log_offsets()
            stack.start(holder)
            _wait(lambda: "waits for the lock" in stack.log_text(holder, back), 30,
                  f"{holder} standing by")
            time.sleep(2)
            assert _stored(stack, ids + more) == (1000, 1000)
        finally:
            pub.close()
    finally:
        stack.extra_env.pop("MQTT_PROTOCOL", None)
