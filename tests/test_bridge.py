"""The bridge against a real broker (embedded in `make test`, Mosquitto in CI's second run),
with the simulator as the peer node."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from django.conf import settings
from django.db import connection

from messages import protocol
from messages.bridge import Bridge
from messages.models import Direction, Message, Status
from messages.outbound import SendRequest, message_send, messages_send
from messages.sweeps import deliveries_sweep
from reachconsole.dev.simulator import Knobs, SimulatedCluster
from roster.models import Agent, ClusterNode
from tests.conftest import TOKEN, register, stop_process
from tests.mqtt import free_port
from tests.processes import ROOT, database_url

pytestmark = pytest.mark.django_db(transaction=True)
MT = protocol.MessageType


def eventually(check, timeout: float = 15.0, what: str = "condition", detail=None):
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    shown = f"; {detail()!r}" if detail else ""
    raise AssertionError(f"{what} did not happen within {timeout} s (last: {value!r}){shown}")


@pytest.fixture
def cluster(live_server, mqtt_settings):
    sim = SimulatedCluster(
        base_url=live_server.url, token=TOKEN, mqtt_url=settings.MQTT_URL, nodes=1, agents=2,
        prefix=settings.MQTT_TOPIC_PREFIX, mqtt_protocol=settings.MQTT_PROTOCOL,
        knobs=Knobs(rate=0, slow_ms=0), heartbeat_ms=200,
    )
    sim.start()
    assert sim.wait_subscribed(), "a simulated node never subscribed to its inbox"
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
    assert done.acked_at is not None
    # Some brokers (RabbitMQ) send the PUBACK after routing, so the node's answer can come
    # first; the row then takes the time the broker took it when the PUBACK arrives
    # (messages.state.late_pubacks_record).
    eventually(lambda: Message.objects.filter(pk=row.pk, published_at__isnull=False).exists(),
               what="the broker's PUBACK recorded")
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
    assert bridge.session.connected.is_set()

    def rejected():
        text = client.get("/metrics").content.decode()
        return ('reach_rejected_total{reason="not_utf8"}' in text
                and 'reach_rejected_total{reason="wrong_protocol"}' in text
                and 'reach_rejected_total{reason="not_object"}' in text
                and "reach_dropped_self_total" in text and text)

    eventually(rejected, what="the rejections and the dropped echo in /metrics")
    # The bridge says it hears the bus once a second (roster.hearing); a test database flush
    # between tests can take its row away until the next report.
    line = f'reach_bridge_connected{{instance="{bridge.client_id}"}} 1'
    eventually(lambda: line in client.get("/metrics").content.decode(), timeout=10,
               what="the bridge counted as connected in /metrics")


def _start_bridge(env: dict[str, str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "manage.py", "mqtt_bridge"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)


def test_a_killed_bridge_loses_nothing(mqtt_settings, broker, tmp_path):
    """kill -9 in the middle of a burst, publish more while it is down, start it again:
    every message is in the table exactly once."""
    # On NATS the messages the killed bridge had taken but not acknowledged come back only
    # after its ack_wait (30 s in .ci/nats.conf): hence the minute allowed below.
    total, kill_at = 1000, 300
    env = {**os.environ, "DATABASE_URL": database_url(), "MQTT_URL": settings.MQTT_URL,
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
        # Its heartbeat can come before its inbox subscription (in single mode the bridge
        # subscribes once it holds the ingest lock), and a message published before that
        # matches nothing on the broker: probe until one is stored, as a sender would.
        probes: list[str] = []

        def probe_stored() -> bool:
            probe = protocol.new_envelope(message_type=MT.EVENT, from_agent_id="fin.tax",
                                          payload={"probe": len(probes)})
            probes.append(probe.message_id)
            publisher.publish(topic, protocol.encode(probe), qos=1).wait_for_publish(5)
            time.sleep(0.2)
            return Message.objects.filter(message_id__in=probes).exists()

        eventually(probe_stored, timeout=30, what="the bridge storing what its inbox receives")
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

        def missing() -> str:
            stored = set(Message.objects.filter(message_id__in=ids)
                         .values_list("message_id", flat=True))
            gone = [i for i, message_id in enumerate(ids) if message_id not in stored]
            log.seek(0)
            return (f"{len(gone)} missing (publish order {gone[:5]}…{gone[-5:]}), "
                    f"{stored_while_down} stored before the restart; bridge log tail: "
                    f"{log.read()[-1500:]}")

        count = eventually(
            lambda: (n := Message.objects.filter(message_id__in=ids).count()) == total and n,
            timeout=60, what=f"all {total} messages stored after the restart", detail=missing)
        assert count == total
        assert Message.objects.filter(direction=Direction.OBSERVED).exclude(
            message_id__in=probes).count() == total
    finally:
        publisher.loop_stop()
        publisher.disconnect()
        stop_process(proc, 15)
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
        assert sim.wait_subscribed(), "a simulated node never subscribed to its inbox"
        rerouted = 0
        for n in range(4):
            row = message_send(request=SendRequest(to="capability:tax", from_agent_id="fin.me",
                                                   payload={"n": n}))
            assert row.status == Status.SENT
            trail = lambda row=row: ([  # noqa: E731 - what a failure message shows
                (m.direction, m.message_type, m.to_agent_id, m.status, m.error)
                for m in Message.objects.filter(task_id=row.task_id).order_by("id")],
                {n.node_id: dict(n.received) for n in sim.nodes})
            eventually(lambda row=row: Message.objects.filter(
                task_id=row.task_id, status=Status.COMPLETED).exists(),
                what=f"task {n} completing", detail=trail)
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


def test_wait_answers_with_the_response(bridge, cluster, api):
    agent_id = cluster.nodes[0].agents[0].agent_id
    eventually(lambda: Agent.objects.filter(agent_id=agent_id,
                                            last_heartbeat_at__isnull=False).exists(),
               what="the simulated agent heartbeating")
    r = api.post("/api/a2a/send", {"to": agent_id, "payload": {"q": 7}, "wait": True,
                                   "timeoutMs": 10000})
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["status"] == "COMPLETED"
    assert body["response"] == {"ok": True, "result": {"echo": {"q": 7},
                                                       "by": cluster.nodes[0].node_id}}


def test_wait_times_out_with_honest_words(api):
    register("fin.silent", "node-nobody")
    r = api.post("/api/a2a/send", {"to": "fin.silent", "wait": True, "timeoutMs": 300})
    assert r.status_code == 202
    body = r.json()
    assert body["detail"] == (
        "the response did not arrive in time; the task may have been accepted — query "
        f"GET /api/a2a/messages/{body['messageId']} later")
    assert Message.objects.get(message_id=body["messageId"]).status in {"SENT", "PUBLISHED"}


class PrivateMosquitto:
    """A Mosquitto of this test's own, so it can be restarted without touching anyone's."""

    def __init__(self, tmp_path):
        self.port = free_port()
        self.conf = tmp_path / "mosquitto.conf"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
            "max_queued_messages 100000\nmax_inflight_messages 100\n")
        self.proc = None
        self.url = f"mqtt://127.0.0.1:{self.port}"

    def start(self):
        self.proc = subprocess.Popen(["mosquitto", "-c", str(self.conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        eventually(lambda: _port_open(self.port), 10, "mosquitto listening")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class EmbeddedBrokerProcess:
    """The embedded broker in a process of its own, stopped with SIGKILL: a broker crash,
    with everything it held lost."""

    def __init__(self):
        self.port = free_port()
        self.url = f"mqtt://127.0.0.1:{self.port}"
        self.proc = None

    def start(self):
        code = ("import time; from reachconsole.dev.embedded_broker import EmbeddedBroker; "
                f"EmbeddedBroker(port={self.port}).start(); time.sleep(10**6)")
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
        eventually(lambda: _port_open(self.port), 20, "the embedded broker listening")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_broker_restart_mid_run_loses_nothing_and_runs_nothing_twice(
        live_server, mqtt_settings, tmp_path, settings):
    """Every task acknowledged, each executed exactly once at its receiver, though the
    broker restarts (losing everything it held) in the middle of the run. Each task is four
    messages on the bus (request, ACK, response, ACK): 2,500 tasks, a 10,000-message run,
    through Mosquitto in CI's second run; 1,000 through the embedded broker, which is
    slower, on embedded defaults."""
    if settings.MQTT_URL.startswith("mqtt://127.0.0.1:1883") and shutil.which("mosquitto"):
        broker = PrivateMosquitto(tmp_path)
        total, protocol_version = 2_500, "5"
    else:
        broker = EmbeddedBrokerProcess()
        total, protocol_version = 1_000, "3.1.1"
    total = int(os.environ.get("REACH_RESTART_TEST_TASKS", total))
    broker.start()
    settings.MQTT_URL, settings.MQTT_PROTOCOL = broker.url, protocol_version
    settings.REACH_ACK_TIMEOUT_MS = 2000
    settings.REACH_MONITOR = False
    bridge = Bridge.from_settings()
    bridge.start()
    sim = SimulatedCluster(
        base_url=live_server.url, token=TOKEN, mqtt_url=broker.url, nodes=2, agents=4,
        prefix=settings.MQTT_TOPIC_PREFIX, mqtt_protocol=protocol_version,
        knobs=Knobs(rate=0, slow_ms=0), heartbeat_ms=500,
    )
    sim.start()
    stop_sweeping = threading.Event()

    sweep_errors: list[str] = []

    def sweeper():  # what beat does every REACH_RETRY_SWEEP_S; a failed run is just retried
        while not stop_sweeping.wait(0.2):
            try:
                deliveries_sweep()
            except Exception as exc:
                sweep_errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                connection.close()

    sweeping = threading.Thread(target=sweeper, daemon=True)
    try:
        assert bridge.wait_connected(10)
        assert sim.wait_subscribed(), "a simulated node never subscribed to its inbox"
        agents = [a.agent_id for node in sim.nodes for a in node.agents]
        eventually(lambda: Agent.objects.filter(agent_id__in=agents,
                                                last_heartbeat_at__isnull=False).count() == 4,
                   what="the simulated agents heartbeating")
        sweeping.start()
        for start in range(0, total, 1000):
            messages_send(requests=[
                SendRequest(to=agents[i % 4], task_id=f"run-{i}", payload={"i": i},
                            timeout_ms=600_000) for i in range(start, min(total, start + 1000))])

        def answered() -> int:
            return (Message.objects.filter(direction=Direction.SEND,
                                           status__in=[Status.ACKED, Status.COMPLETED])
                    .values("task_id").distinct().count())

        eventually(lambda: answered() >= total // 3, 180, "a third of the tasks answered")
        assert answered() < total  # the broker goes down with work still under way
        broker.stop()
        time.sleep(1.0)
        broker.start()
        eventually(lambda: answered() == total, 300, f"all {total} tasks acknowledged")
        executions = sim.executions()
        print("sweep errors:", len(sweep_errors), sweep_errors[:3], file=sys.stderr)
        assert len(executions) == total  # lost: 0
        assert max(executions.values()) == 1  # executed twice: 0
    finally:
        stop_sweeping.set()
        sweeping.join(10)
        sim.stop()
        bridge.stop()
        broker.stop()


def test_broker_drops_raise_an_alarm_on_the_roster_page(mqtt_settings, admin_client):
    """Mosquitto's $SYS drop counter is the only place such losses show."""
    import paho.mqtt.client as mqtt

    from messages.subscriptions import BROKER_DROPPED_TOPIC
    from reachconsole.core.broker_drops import broker_drops_forget

    broker_drops_forget()
    bridge = Bridge(url=settings.MQTT_URL, node_id="console", prefix=settings.MQTT_TOPIC_PREFIX)

    def counter(value: bytes) -> mqtt.MQTTMessage:
        message = mqtt.MQTTMessage(topic=BROKER_DROPPED_TOPIC.encode())
        message.payload = value
        return message

    for value in (b"7", b"7", b"12", b"not a number"):
        bridge.session._on_message(None, None, counter(value))
    assert bridge.session.dropped_total == 12 and bridge.counts["broker_dropped"] == 5
    html = admin_client.get("/").content.decode()
    assert 'id="broker-drops"' in html and "dropped 5 messages" in html
    broker_drops_forget()
    assert 'id="broker-drops"' not in admin_client.get("/").content.decode()


def test_the_owner_keeps_its_connection_until_it_fails():
    """Between turns the owner thread keeps its connection (a pool check per batch was on
    every message's path); after a database error it lets it go and the next query takes
    a fresh one."""
    from django.db import DatabaseError

    from messages.bridge import connection_keep

    seen = {}

    def owner() -> None:
        try:
            Message.objects.exists()
            first = connection.connection
            connection_keep()
            Message.objects.exists()
            seen["kept"] = connection.connection is first
            with pytest.raises(DatabaseError):
                with connection.cursor() as cursor:
                    cursor.execute("SELECT * FROM no_such_table_here")
            connection_keep()
            seen["dropped"] = connection.connection is None or connection.connection is not first
            Message.objects.exists()
            seen["works"] = connection.connection is not None
        finally:
            connection.close()

    thread = threading.Thread(target=owner)
    thread.start()
    thread.join(30)
    assert seen == {"kept": True, "dropped": True, "works": True}


def test_two_consoles_on_one_broker_keep_their_own_sessions(mqtt_settings, caplog):
    """Two consoles with separate databases and the default node id were both
    `reach-console-1`: they took each other's session every second, and the log said only
    "disconnected (Unspecified error)"."""
    import logging

    from messages.client_ids import client_id_for, legacy_client_ids
    from reachconsole.core.identity import address_identity

    bridges = [Bridge(url=settings.MQTT_URL, node_id="console", console_id=console,
                      prefix=f"{settings.MQTT_TOPIC_PREFIX}{n}", instance="1",
                      protocol_version=settings.MQTT_PROTOCOL)
               for n, console in enumerate(("reach-aaaaaaaaaaaa", "reach-bbbbbbbbbbbb"))]
    assert [b.client_id for b in bridges] == ["reach-aaaaaaaaaaaa-console-1",
                                              "reach-bbbbbbbbbbbb-console-1"]
    # Long node ids keep the instance: two bridges of one console never share an id.
    long_ids = {client_id_for("n" * 100, str(i), "reach-cccccccccccc") for i in (1, 2)}
    assert len(long_ids) == 2 and all(len(i) <= 64 and i.endswith(("-1", "-2"))
                                      for i in long_ids)
    with caplog.at_level(logging.INFO, logger="messages.client_ids"):
        for bridge in bridges:
            bridge.start()
        try:
            assert all(b.wait_connected(10) for b in bridges)
            # Each ends the session its console's earlier version left under the old id.
            deadline = time.monotonic() + 10
            while "earlier client id reach-console-1" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.1)
            time.sleep(3)  # several of the old clash's rounds: each bridge stays connected
            assert [b.session.generation for b in bridges] == [1, 1]
            assert all(b.session.connected.is_set() for b in bridges)
        finally:
            for bridge in bridges:
                bridge.stop()
    # Before the identity was in the id, and while it was a hash of the address's spelling.
    assert legacy_client_ids("console", "1") == [
        "reach-console-1",
        client_id_for("console", "1", address_identity(settings.DATABASES["default"]))]
    assert "took over" not in caplog.text


def test_a_broker_that_closes_each_connection_at_once_is_said_to_have_another_client():
    """MQTT 3.1.1 brokers close the older of two clients with one id without a reason."""
    import logging

    bridge = Bridge(url="mqtt://127.0.0.1:1", node_id="console", prefix="p", instance="x",
                    console_id="reach-dddddddddddd")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("messages.mqtt_session")
    logger.addHandler(handler)
    try:
        for _ in range(3):
            bridge.session.connected.set()
            bridge.session.connected_at = time.monotonic()  # connected just now, as on a CONNACK
            bridge.session._on_disconnect(None, None, None, 7, None)
    finally:
        logger.removeHandler(handler)
    said = [r.getMessage() for r in records if r.levelno == logging.ERROR]
    assert len(said) == 1 and "another client with this id took over" in said[0]
    assert "reach-dddddddddddd-console-x" in said[0]
