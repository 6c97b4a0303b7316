"""The embedded amqtt broker, exercised with the same paho-mqtt 2.x client the console uses."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from reachconsole.dev.embedded_broker import BrokerPortInUse, EmbeddedBroker

WAIT = 5.0
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Peer:
    """A paho client whose callbacks feed events the test can wait on."""

    def __init__(self, port: int, client_id: str = "", *, clean_session: bool = True) -> None:
        self.port = port
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=clean_session,
            protocol=mqtt.MQTTv311,
        )
        self.connected = threading.Event()
        self.subscribed = threading.Event()
        self.disconnected = threading.Event()
        self.session_present: bool | None = None
        self.connect_reason: mqtt.ReasonCode | None = None
        self.messages: list[mqtt.MQTTMessage] = []
        self._expected = 0
        self.all_received = threading.Event()
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *_: self.subscribed.set()
        self.client.on_disconnect = lambda *_: self.disconnected.set()
        self.client.on_message = self._on_message

    def _on_connect(self, _client, _userdata, flags, reason_code, _properties) -> None:
        self.session_present = flags.session_present
        self.connect_reason = reason_code
        self.connected.set()

    def _on_message(self, _client, _userdata, message: mqtt.MQTTMessage) -> None:
        self.messages.append(message)
        if len(self.messages) >= self._expected:
            self.all_received.set()

    def expect(self, count: int) -> None:
        self._expected = count

    def connect(self) -> Peer:
        self.client.connect("127.0.0.1", self.port, keepalive=10)
        self.client.loop_start()
        assert self.connected.wait(WAIT), "no CONNACK from the embedded broker"
        assert not self.connect_reason.is_failure, self.connect_reason
        return self

    def subscribe(self, topic: str) -> None:
        self.client.subscribe(topic, qos=1)
        assert self.subscribed.wait(WAIT), f"no SUBACK for {topic}"

    def publish_all(self, topic: str, payloads: list[bytes]) -> None:
        infos = [self.client.publish(topic, payload, qos=1) for payload in payloads]
        for info in infos:
            info.wait_for_publish(WAIT)
            assert info.is_published()

    def close(self) -> None:
        if self.client.is_connected():
            self.client.disconnect()
            self.disconnected.wait(WAIT)
        self.client.loop_stop()


@pytest.fixture
def broker() -> Iterator[EmbeddedBroker]:
    embedded = EmbeddedBroker(host="127.0.0.1", port=free_port())
    embedded.start()
    yield embedded
    embedded.stop()


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    made: list[Peer] = []
    yield made
    for peer in made:
        peer.close()


def test_it_delivers_qos1_messages_in_order_through_a_wildcard(broker, peers):
    subscriber = Peer(broker.port, "console-bridge").connect()
    publisher = Peer(broker.port, "node-b").connect()
    peers.extend([subscriber, publisher])
    subscriber.subscribe("t/node/+/inbox")
    payloads = [f"msg-{i}".encode() for i in range(50)]
    subscriber.expect(len(payloads))

    publisher.publish_all("t/node/b/inbox", payloads)

    assert subscriber.all_received.wait(WAIT), f"got {len(subscriber.messages)} of 50"
    assert [m.payload for m in subscriber.messages] == payloads
    assert {m.topic for m in subscriber.messages} == {"t/node/b/inbox"}
    assert {m.qos for m in subscriber.messages} == {1}


def test_it_queues_qos1_messages_for_an_offline_persistent_session(broker, peers):
    first = Peer(broker.port, "persistent-bridge", clean_session=False).connect()
    peers.append(first)
    first.subscribe("t/node/a/inbox")
    first.close()
    assert first.disconnected.is_set()

    publisher = Peer(broker.port, "node-b").connect()
    peers.append(publisher)
    payloads = [f"offline-{i}".encode() for i in range(20)]
    publisher.publish_all("t/node/a/inbox", payloads)

    again = Peer(broker.port, "persistent-bridge", clean_session=False)
    peers.append(again)
    again.expect(len(payloads))
    again.connect()

    assert again.session_present is True
    assert again.all_received.wait(WAIT), f"got {len(again.messages)} of 20"
    # Sorted, not in arrival order: amqtt may still be fanning the last publishes out when the
    # session comes back, and those go live while the queued ones are replayed.
    assert sorted(m.payload for m in again.messages) == sorted(payloads)
    assert len(again.messages) == len(payloads)


def test_it_refuses_a_port_that_is_already_taken(broker, peers):
    second = EmbeddedBroker(host="127.0.0.1", port=broker.port)

    with pytest.raises(BrokerPortInUse) as excinfo:
        second.start()

    assert "MQTT_URL" in str(excinfo.value)
    assert f"127.0.0.1:{broker.port}" in str(excinfo.value)
    # The failed start must not have disturbed the broker that owns the port.
    peers.append(Peer(broker.port, "still-served").connect())


def test_it_releases_the_port_on_stop_and_tolerates_a_second_stop():
    port = free_port()
    embedded = EmbeddedBroker(host="127.0.0.1", port=port)
    assert embedded.url == f"mqtt://127.0.0.1:{port}"
    embedded.start()
    # Driven by hand rather than loop_start(): paho's network thread would sit out a reconnect
    # back-off after the broker goes away, slowing teardown by a second.
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="short-lived")
    dropped = threading.Event()
    client.on_disconnect = lambda *_: dropped.set()
    client.connect("127.0.0.1", port, keepalive=10)
    deadline = time.monotonic() + WAIT
    while not client.is_connected() and time.monotonic() < deadline:
        client.loop(0.05)
    assert client.is_connected()

    embedded.stop()
    embedded.stop()

    while not dropped.is_set() and time.monotonic() < deadline:
        client.loop(0.05)
    assert dropped.is_set(), "stop() left a client connection open"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=WAIT).close()
    # The broker closed that connection first, leaving a server-side TIME_WAIT on the port; it
    # must not read as "port in use" when the console restarts.
    with EmbeddedBroker(host="127.0.0.1", port=port):
        Peer(port, "after-restart").connect().close()


def test_importing_it_patches_no_library_and_starting_it_does():
    # In a process of its own: brokers started by other tests have patched this one already.
    code = (
        "import amqtt.broker\n"
        "from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler\n"
        "from reachconsole.dev import embedded_broker\n"
        "assert amqtt.broker.BrokerProtocolHandler is BrokerProtocolHandler\n"
        f"with embedded_broker.EmbeddedBroker(port={free_port()}):\n"
        "    assert amqtt.broker.BrokerProtocolHandler is embedded_broker.KeepInflightHandler\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
