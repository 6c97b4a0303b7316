"""The bridge against a real broker (embedded in `make test`, Mosquitto in CI's second run),
with the simulator as the peer node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from messages import protocol
from messages.bridge import Bridge
from messages.models import Direction, Message, Status
from messages.outbound import SendRequest, message_send
from messages.simulator import Knobs, SimulatedCluster
from roster.models import Agent, ClusterNode
from tests.conftest import TOKEN

pytestmark = pytest.mark.django_db(transaction=True)
ROOT = Path(__file__).resolve().parent.parent
MT = protocol.MessageType


def eventually(check, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout} s (last: {value!r})")


@pytest.fixture
def bridge(mqtt_settings):
    instance = Bridge(
        url=settings.MQTT_URL, node_id="console", prefix=settings.MQTT_TOPIC_PREFIX,
        instance=uuid.uuid4().hex[:8], protocol_version=settings.MQTT_PROTOCOL,
        heartbeat_ms=200,
    )
    instance.start()
    assert instance.wait_connected(10)
    yield instance
    instance.stop()


@pytest.fixture
def cluster(live_server, mqtt_settings):
    sim = SimulatedCluster(
        base_url=live_server.url, token=TOKEN, mqtt_url=settings.MQTT_URL, nodes=1, agents=2,
        prefix=settings.MQTT_TOPIC_PREFIX, mqtt_protocol=settings.MQTT_PROTOCOL,
        knobs=Knobs(rate=0, slow_ms=0), heartbeat_ms=200,
    )
    sim.start()
    yield sim
    sim.stop()


def test_a_task_round_trips_to_a_simulated_node_and_back(bridge, cluster):
    node = cluster.nodes[0]
    agent_id = node.agents[0].agent_id
    eventually(lambda: ClusterNode.objects.filter(node_id=node.node_id,
                                                  last_seen_at__isnull=False).exists(),
               what="the simulated node's MQTT heartbeat")
    assert Agent.objects.get(agent_id=agent_id).last_heartbeat_at is not None

    row = message_send(request=SendRequest(to=agent_id, payload={"q": "hello"}))
    assert row.status == Status.SENT
    done = eventually(
        lambda: Message.objects.filter(pk=row.pk, status=Status.COMPLETED).first(),
        what="the TASK_RESPONSE")
    assert done.published_at is not None and done.acked_at is not None
    steps = list(done.transitions.values_list("to_status", flat=True))
    assert steps[0] == "SENT" and steps[-2:] == ["ACKED", "COMPLETED"]
    response = Message.objects.get(in_reply_to=row.message_id, message_type="TASK_RESPONSE")
    assert response.direction == Direction.RECV
    assert response.payload["result"]["echo"] == {"q": "hello"}
    # The console acknowledges the response, and the node hears that ACK.
    eventually(lambda: Message.objects.filter(in_reply_to=response.message_id,
                                              message_type="ACK",
                                              status=Status.PUBLISHED).exists(),
               what="the console's ACK of the response")
    eventually(lambda: node.received["ACK"] >= 1, what="the node hearing the ACK")
    assert node.executions[row.idempotency_key] == 1


def test_garbage_is_counted_and_the_bridge_keeps_working(bridge, broker, client):
    prefix = settings.MQTT_TOPIC_PREFIX
    inbox = protocol.inbox_topic(prefix, "console")
    publisher = broker.client()
    try:
        for payload in (b"\x00\xffgarbage", b'{"protocol":"other"}', b"[]",
                        json.dumps({"protocol": "a2a", "version": "1.0",
                                    "message": {"messageId": "x", "messageType": "TASK_REQUEST",
                                                "payload": {"text": "nul \u0000 inside"}}}
                                   ).encode()):
            publisher.publish(inbox, payload, qos=1).wait_for_publish(5)
        probe = protocol.new_envelope(
            message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="ops.probe",
            headers={"replyNodeId": "node-x"}, payload={},
        )
        publisher.publish(inbox, protocol.encode(probe), qos=1).wait_for_publish(5)
    finally:
        publisher.loop_stop()
        publisher.disconnect()
    eventually(lambda: Message.objects.filter(message_id=probe.message_id,
                                              status=Status.LOCAL_CONSUMED).exists(),
               what="the request after the garbage")
    assert bridge.connected.is_set()

    def rejected():
        text = client.get("/metrics").content.decode()
        return ('reach_rejected_total{reason="not_utf8"}' in text
                and 'reach_rejected_total{reason="wrong_protocol"}' in text
                and 'reach_rejected_total{reason="not_object"}' in text
                and "reach_dropped_self_total" in text and text)

    text = eventually(rejected, what="the rejections and the dropped echo in /metrics")
    assert "reach_bridge_connected 1" in text


def _database_url() -> str:
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def _start_bridge(env: dict[str, str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "manage.py", "mqtt_bridge"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)


def test_a_killed_bridge_loses_nothing(mqtt_settings, broker, tmp_path):
    """kill -9 in the middle of a burst, publish more while it is down, start it again:
    every message is in the table exactly once."""
    total, kill_at = 1000, 300
    env = {**os.environ, "DATABASE_URL": _database_url(), "MQTT_URL": settings.MQTT_URL,
           "MQTT_PROTOCOL": settings.MQTT_PROTOCOL, "MQTT_TOPIC_PREFIX": settings.MQTT_TOPIC_PREFIX,
           "REACH_NODE_ID": "console", "REACH_BRIDGE_INSTANCE": f"kill-{uuid.uuid4().hex[:6]}",
           "REACH_RUN_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "bridge.log", "w+")  # noqa: SIM115 - closed below
    proc = _start_bridge(env, log)
    publisher = broker.client()
    try:
        eventually(lambda: ClusterNode.objects.filter(node_id="console",
                                                      last_seen_at__isnull=False).exists(),
                   timeout=30, what="the bridge subprocess starting")
        topic = protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX, "node-z")
        ids = []
        for i in range(total):
            env_ = protocol.new_envelope(message_type=MT.EVENT, from_agent_id="fin.tax",
                                         to_agent_id="llm.chat", payload={"n": i})
            ids.append(env_.message_id)
            publisher.publish(topic, protocol.encode(env_), qos=1)
            if i == kill_at:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        time.sleep(0.5)
        stored_while_down = Message.objects.filter(message_id__in=ids).count()
        assert stored_while_down < total
        proc = _start_bridge(env, log)
        count = eventually(
            lambda: (n := Message.objects.filter(message_id__in=ids).count()) == total and n,
            timeout=60, what=f"all {total} messages stored after the restart")
        assert count == total
        assert Message.objects.filter(direction=Direction.OBSERVED).count() == total
    finally:
        publisher.loop_stop()
        publisher.disconnect()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


def test_a_busy_answer_reroutes_a_capability_send(bridge, live_server, mqtt_settings):
    """Two nodes offer `tax`; node a answers BUSY to everything. Every task still completes,
    on node c, and a BUSY send is followed by a new attempt linked to it."""
    sim = SimulatedCluster(
        base_url=live_server.url, token=TOKEN, mqtt_url=settings.MQTT_URL, nodes=3, agents=15,
        prefix=settings.MQTT_TOPIC_PREFIX, mqtt_protocol=settings.MQTT_PROTOCOL,
        knobs=Knobs(rate=0, slow_ms=0, busy_nodes=frozenset({"sim-node-a"})), heartbeat_ms=200,
    )
    busy_node, good_node = sim.nodes[0], sim.nodes[2]
    assert busy_node.hosts("fin.tax") and good_node.hosts("fin.tax-2")
    sim.start()
    try:
        eventually(lambda: Agent.objects.filter(agent_id__in=["fin.tax", "fin.tax-2"],
                                                last_heartbeat_at__isnull=False).count() == 2,
                   what="both nodes heartbeating")
        rerouted = 0
        for n in range(4):
            row = message_send(request=SendRequest(to="capability:tax", from_agent_id="fin.me",
                                                   payload={"n": n}))
            assert row.status == Status.SENT
            eventually(lambda row=row: Message.objects.filter(
                task_id=row.task_id, status=Status.COMPLETED).exists(),
                what=f"task {n} completing")
            busy = Message.objects.filter(task_id=row.task_id, status=Status.BUSY)
            for b in busy:
                retry = Message.objects.get(resend_of=b)
                assert (retry.attempt, retry.to_agent_id) == (b.attempt + 1, "fin.tax-2")
                assert retry.idempotency_key == b.idempotency_key
                rerouted += 1
            if rerouted and n >= 1:
                break
        assert rerouted >= 1
        assert sum(busy_node.executions.values()) == 0
        assert all(count == 1 for count in good_node.executions.values())
    finally:
        sim.stop()
