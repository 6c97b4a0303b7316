"""The shipped broker configuration is not open (deploy/mosquitto.conf, deploy/mosquitto.acl):
no anonymous client, one account per node named by its nodeId, and a node that reads only
its own inbox and heartbeats only as itself; the console's own account reads and writes the
whole bus, so its real bridge (shared subscriptions, the heartbeat wildcard, its probe, the
broker's drop counter) works through it.

A PRIVATE Mosquitto from the deployment's files (tests/deploy_broker.py). Each refusal is
shown against a control: a message the same client may send, sent after the refused one,
arrives, so the refused one would have arrived before it."""

from __future__ import annotations

import queue
import shutil
import time
import uuid

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.reasoncodes import ReasonCode

from messages import protocol
from messages.bridge import Bridge
from messages.models import Message
from messages.subscriptions import BROKER_DROPPED_TOPIC
from roster.models import BusHearing, ClusterNode
from tests.conftest import expect_real_services, register
from tests.deploy_broker import Broker, private_mosquitto
from tests.processes import HOST

pytestmark = [
    pytest.mark.skipif(not (shutil.which("mosquitto") or expect_real_services()),
                       reason="starts a private Mosquitto: it is not installed"),
    pytest.mark.timeout(120),
]
PREFIX = "ooder"  # the prefix deploy/mosquitto.acl's node lines name
NODES = {"node-a": "password-of-node-a", "node-b": "password-of-node-b"}


@pytest.fixture(scope="module")
def broker():
    with private_mosquitto(users=NODES) as running:
        yield running


class Client:
    """One MQTT 5 client signed in as `user` (None: anonymous), keeping what it receives."""

    def __init__(self, broker: Broker, user: str | None, password: str | None = None,
                 client_id: str = ""):
        self.got: queue.Queue = queue.Queue()
        self.connack: queue.Queue = queue.Queue()
        self.suback: queue.Queue = queue.Queue()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                  client_id=client_id or f"acl-{user}-{uuid.uuid4().hex[:6]}",
                                  protocol=mqtt.MQTTv5)
        if user:
            self.client.username_pw_set(user, password or broker.passwords[user])
        self.client.on_connect = lambda c, u, f, rc, p: self.connack.put(rc)
        self.client.on_subscribe = lambda c, u, mid, rcs, p: self.suback.put(rcs)
        self.client.on_message = lambda c, u, m: self.got.put((m.topic, m.payload))
        self.client.connect(HOST, broker.port)
        self.client.loop_start()
        self.reason: ReasonCode = self.connack.get(timeout=10)

    def subscribe(self, *topics: str) -> list[ReasonCode]:
        self.client.subscribe([(t, 1) for t in topics])
        return self.suback.get(timeout=10)

    def publish(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1).wait_for_publish(10)

    def received_until(self, marker: bytes, timeout: float = 10) -> list[tuple[str, bytes]]:
        """Everything received up to and including `marker`."""
        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                item = self.got.get(timeout=0.2)
            except queue.Empty:
                continue
            seen.append(item)
            if item[1] == marker:
                return seen
        raise AssertionError(f"the control message {marker!r} did not arrive: {seen}")

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def test_no_anonymous_client_and_no_wrong_password_is_let_in(broker):
    anonymous = Client(broker, None)
    wrong = Client(broker, "node-a", "not-its-password")
    try:
        assert anonymous.reason.is_failure and anonymous.reason.getName() == "Not authorized"
        assert wrong.reason.is_failure
    finally:
        anonymous.close()
        wrong.close()
    node = Client(broker, "node-a")
    try:
        assert not node.reason.is_failure
    finally:
        node.close()


def test_a_node_heartbeats_only_as_itself(broker):
    console = Client(broker, "console")
    node_a = Client(broker, "node-a")
    try:
        console.subscribe(protocol.heartbeat_wildcard(PREFIX))
        node_a.publish(protocol.heartbeat_topic(PREFIX, "node-b"), b"forged")
        node_a.publish(protocol.heartbeat_topic(PREFIX, "node-a"), b"own")
        got = console.received_until(b"own")
        assert got == [(protocol.heartbeat_topic(PREFIX, "node-a"), b"own")]
    finally:
        console.close()
        node_a.close()


def test_a_node_reads_only_its_own_inbox_and_sends_to_any(broker):
    node_a = Client(broker, "node-a")
    node_b = Client(broker, "node-b")
    console = Client(broker, "console")
    try:
        node_a.subscribe(protocol.inbox_topic(PREFIX, "node-a"),
                         protocol.inbox_topic(PREFIX, "node-b"), protocol.inbox_wildcard(PREFIX))
        node_b.subscribe(protocol.inbox_topic(PREFIX, "node-b"))
        console.subscribe(protocol.inbox_topic(PREFIX, "console"))
        node_b.publish(protocol.inbox_topic(PREFIX, "node-b"), b"for b")   # to itself
        node_a.publish(protocol.inbox_topic(PREFIX, "console"), b"answer")  # to the console
        console.publish(protocol.inbox_topic(PREFIX, "node-a"), b"for a")
        # node-a subscribed to b's inbox and the wildcard, but is sent only its own.
        assert node_a.received_until(b"for a") == [(protocol.inbox_topic(PREFIX, "node-a"),
                                                    b"for a")]
        assert node_b.received_until(b"for b")[-1][1] == b"for b"
        assert console.received_until(b"answer")[-1][1] == b"answer"
    finally:
        for client in (node_a, node_b, console):
            client.close()


def test_a_node_cannot_read_the_brokers_counters_and_the_console_can(broker):
    console = Client(broker, "console")
    node_a = Client(broker, "node-a")
    try:
        console.subscribe(BROKER_DROPPED_TOPIC)
        node_a.subscribe(BROKER_DROPPED_TOPIC)
        topic, value = console.got.get(timeout=15)  # sys_interval 5: within a round or two
        assert topic == BROKER_DROPPED_TOPIC and int(value) >= 0
        time.sleep(6)  # another round
        assert node_a.got.empty()
    finally:
        console.close()
        node_a.close()


def test_a2a_profile_agents_write_their_own_card_and_the_console_reads_them(broker):
    console = Client(broker, "console")
    node_a = Client(broker, "node-a")
    agent_id = f"acl{uuid.uuid4().hex[:6]}/ops/echo"
    # The profile's agent: its client id is its agent id (its account here is node-b's).
    agent = Client(broker, "node-b", client_id=agent_id)
    try:
        # `#` alone would not grant it: topics that begin with `$` need a line of their own.
        assert not any(rc.is_failure for rc in console.subscribe("$a2a/v1/discovery/+/+/+"))
        node_a.subscribe("$a2a/v1/discovery/+/+/+", f"{PREFIX}/node/node-a/inbox")
        agent.publish(f"$a2a/v1/discovery/{agent_id}/x", b"not its card")
        agent.publish(f"$a2a/v1/discovery/{agent_id}", b"{}")
        # Its own card arrives; a topic beside it was not its to write.
        assert console.received_until(b"{}") == [(f"$a2a/v1/discovery/{agent_id}", b"{}")]
        # The console reads only: a card it publishes goes nowhere. The node's subscription is
        # granted, but Mosquitto delivers only what it may read: the marker that follows on
        # its own inbox comes alone (to the console too, which reads every inbox).
        console.subscribe(f"{PREFIX}/node/node-a/inbox")
        console.publish(f"$a2a/v1/discovery/{agent_id}", b"the console's")
        console.publish(f"{PREFIX}/node/node-a/inbox", b"marker")
        inbox = (f"{PREFIX}/node/node-a/inbox", b"marker")
        assert node_a.received_until(b"marker") == [inbox]
        assert console.received_until(b"marker") == [inbox]
    finally:
        console.close()
        node_a.close()
        agent.close()


@pytest.mark.django_db(transaction=True)
def test_the_consoles_real_bridge_works_through_its_account(broker, settings):
    """Shared subscriptions of the inboxes, the heartbeat wildcard and the probe, all
    through the console's account: a node's heartbeat renews its agent, and the bridge
    hears its own probe (docs/faults.md: the bus is heard)."""
    settings.MQTT_TOPIC_PREFIX = PREFIX
    register("fin.tax", "node-a")
    bridge = Bridge(url=broker.url(), node_id="console", prefix=PREFIX,
                    instance=f"acl-{uuid.uuid4().hex[:6]}", protocol_version="5",
                    session_expiry_s=0)
    bridge.start()
    node_a = Client(broker, "node-a")
    try:
        assert bridge.wait_connected(15), "the bridge could not sign in with its account"
        beat = protocol.new_envelope(
            message_type=protocol.MessageType.HEARTBEAT, from_agent_id="node-a",
            headers={"originNodeId": "node-a"},
            payload={"heartbeatMs": 1000, "agents": [{"agentId": "fin.tax", "inflight": 3}]})
        event = protocol.new_envelope(message_type=protocol.MessageType.EVENT,
                                      from_agent_id="fin.tax", to_agent_id="console",
                                      headers={"originNodeId": "node-a"}, payload={"n": 1})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            node_a.publish(protocol.heartbeat_topic(PREFIX, "node-a"), protocol.encode(beat))
            node_a.publish(protocol.inbox_topic(PREFIX, "console"), protocol.encode(event))
            node = ClusterNode.objects.filter(node_id="node-a").first()
            if node and node.last_seen_at and Message.objects.filter(
                    message_id=event.message_id).exists():
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the bridge stored neither the heartbeat nor the event: "
                                 f"{broker.log_path.read_text()[-2000:]}")
        # Its probe went out and came back through the broker: the bus is heard.
        deadline = time.monotonic() + 10
        while not BusHearing.objects.filter(heard_at__isnull=False).exists():
            assert time.monotonic() < deadline, "the bridge's probe never came back"
            time.sleep(0.2)
    finally:
        node_a.close()
        bridge.stop()


def test_the_console_sends_profile_requests_and_its_agents_answer_it_only(broker):
    console = Client(broker, "console")
    org = f"acl{uuid.uuid4().hex[:6]}"
    agent_id, other_id = f"{org}/ops/echo", f"{org}/ops/other"
    agent = Client(broker, "node-b", client_id=agent_id)
    other = Client(broker, "node-a", client_id=other_id)
    try:
        # Each agent subscribes to the echo agent's requests and its own; Mosquitto delivers
        # each only what it may read.
        agent.subscribe(f"$a2a/v1/request/{agent_id}")
        other.subscribe(f"$a2a/v1/request/{agent_id}", f"$a2a/v1/request/{other_id}")
        console.publish(f"$a2a/v1/request/{agent_id}", b"for echo")
        console.publish(f"$a2a/v1/request/{other_id}", b"marker")
        assert agent.received_until(b"for echo") == [(f"$a2a/v1/request/{agent_id}",
                                                      b"for echo")]
        assert other.received_until(b"marker") == [(f"$a2a/v1/request/{other_id}", b"marker")]
        # Replies: to the console's reply tree, not to another requester's.
        console.subscribe("$a2a/v1/reply/#")
        agent.publish(f"$a2a/v1/reply/{org}/ops/asker/s1", b"not the console's")
        agent.publish("$a2a/v1/reply/reachconsole/ops/console/replies", b"answer")
        assert console.received_until(b"answer") == [
            ("$a2a/v1/reply/reachconsole/ops/console/replies", b"answer")]
    finally:
        console.close()
        agent.close()
        other.close()
