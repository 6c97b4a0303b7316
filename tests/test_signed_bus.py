"""Signed envelopes in production shape (tests/stack.py: private PostgreSQL, Redis and
Mosquitto, stock daphne, worker and beat) with REACH_REQUIRE_SIGNED=1: a node holding only
its own key (`manage.py node_key`) gets work done, every message the console sends it checks
with that key, and a forged answer and a forged heartbeat, published on the bus as the node
with the broker's open access, change nothing and are recorded with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest

from messages import protocol
from tests.fakenode import FakeNode
from tests.processes import HOST, ROOT
from tests.stack import Stack, _wait, stack_or_skip

KEYS = "2026-12:" + "s" * 40
NODE, AGENT = "node-s", "sig.worker"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    running = stack_or_skip(extra_env={
        "REACH_SIGNING_KEYS": KEYS, "REACH_REQUIRE_SIGNED": "1",
        "REACH_HEARTBEAT_MS": "1000", "REACH_LEASE_TTL_MS": "3000"})
    try:
        yield running
    finally:
        running.stop()


def sql(stack: Stack, query: str, params: tuple = ()) -> list[tuple]:
    with stack.connect_db() as conn:
        return conn.execute(query, params).fetchall()


def send(stack: Stack, body: dict) -> dict:
    request = urllib.request.Request(
        f"{stack.base_url}/api/a2a/send", data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {stack.token}", "X-OODER-Source": "studio",
                 "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{exc.code}: {exc.read()[:500]!r}") from None


def node_key(stack: Stack) -> str:
    """The node's key as an operator gets it: the console's own command."""
    out = subprocess.run([sys.executable, "manage.py", "node_key", NODE], cwd=ROOT,
                         env=stack.env(), capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"{NODE} REACH_NODE_KEY="), out
    return out.strip().split("=", 1)[1]


def publish_as_the_node(stack: Stack, topic: str, env: protocol.Envelope) -> None:
    """What anyone on the bus can do: publish in the node's name, without its key."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                         client_id=f"forger-{uuid.uuid4().hex[:6]}", protocol=mqtt.MQTTv5)
    client.connect(HOST, stack.mqtt_port)
    client.loop_start()
    try:
        client.publish(topic, protocol.encode(env), qos=1).wait_for_publish(10)
    finally:
        client.disconnect()
        client.loop_stop()


def test_a_signed_node_works_and_forged_answers_and_heartbeats_change_nothing(stack):
    prefix = stack.clean_run()
    node = FakeNode(base_url=stack.base_url, token=stack.token, mqtt_host=HOST,
                    mqtt_port=stack.mqtt_port, prefix=prefix, node_id=NODE, agents=[AGENT],
                    work_s=2.0, heartbeat_s=0.5, key=node_key(stack))
    node.start()
    try:
        _wait(lambda: sql(stack, "SELECT 1 FROM roster_clusternode WHERE node_id = %s AND "
                                 "signed_at IS NOT NULL", (NODE,)), 20,
              "a signed heartbeat taken from the node")
        tasks = [f"sig-{uuid.uuid4().hex[:8]}" for _ in range(6)]
        for task_id in tasks:
            send(stack, {"to": AGENT, "taskId": task_id, "payload": {"n": task_id},
                         "timeoutMs": 60000})

        def acked():
            rows = sql(stack, "SELECT message_id FROM a2a_message WHERE task_id = %s AND "
                              "direction = 'SEND' AND status = 'ACKED'", (tasks[0],))
            return rows[0][0] if rows else None

        request_id = _wait(acked, 30, "the first task acknowledged by its node")
        # While it runs on the node (2 s): an unsigned response in the node's name, and an
        # unsigned heartbeat that would cut the agent's maxInflight to 1.
        forged = protocol.new_envelope(
            message_type=protocol.MessageType.TASK_RESPONSE, from_agent_id=AGENT,
            to_agent_id="console", task_id=tasks[0],
            headers={"inReplyTo": request_id, "originNodeId": NODE, "replyNodeId": NODE},
            payload={"ok": True, "result": {"forged": True}})
        publish_as_the_node(stack, protocol.inbox_topic(prefix, "console"), forged)
        beat = protocol.new_envelope(
            message_type=protocol.MessageType.HEARTBEAT, from_agent_id=NODE,
            headers={"originNodeId": NODE},
            payload={"heartbeatMs": 500, "agents": [{"agentId": AGENT, "maxInflight": 1}]})
        publish_as_the_node(stack, protocol.heartbeat_topic(prefix, NODE), beat)

        def done():
            rows = sql(stack, "SELECT task_id, status FROM a2a_message WHERE task_id = ANY(%s) "
                              "AND direction = 'SEND' AND message_type = 'TASK_REQUEST'",
                       (tasks,))
            return rows if sorted(s for _, s in rows) == ["COMPLETED"] * len(tasks) else None

        _wait(done, 60, "every task completed by the node itself")
        [(error,)] = sql(stack, "SELECT error FROM a2a_message WHERE message_id = %s",
                         (forged.message_id,))
        assert error.startswith("not accepted, changed nothing: it is not signed"), error
        # The task's answer is the node's own, not the forged one.
        [(payload,)] = sql(stack, "SELECT payload FROM a2a_message WHERE in_reply_to = %s AND "
                                  "message_type = 'TASK_RESPONSE' AND error = ''", (request_id,))
        assert payload["result"]["by"] == NODE and "forged" not in payload["result"]
        [(max_inflight,)] = sql(stack, "SELECT max_inflight FROM roster_agent WHERE agent_id "
                                       "= %s", (AGENT,))
        assert max_inflight == 8
        [(refused,)] = sql(stack, "SELECT signature_refused FROM roster_clusternode WHERE "
                                  "node_id = %s", (NODE,))
        assert refused.startswith("a heartbeat: it is not signed") or refused.startswith(
            "a TASK_RESPONSE: it is not signed"), refused
        # Every message the console sent the node checked with the node's own key.
        time.sleep(0.5)
        assert set(node.verdicts) == {"signed"} and node.verdicts["signed"] >= len(tasks)
        assert node.executed_twice() == {}
    finally:
        node.stop()
