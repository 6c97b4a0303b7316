"""A real MQTT broker for tests: Mosquitto when MQTT_URL names one (CI's second run), else
the embedded broker on a free port. Each test gets its own topic prefix."""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import Iterator
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
import pytest
from django.conf import settings

from messages.mqtt_client import broker_target, mqtt_client
from reachconsole.dev.embedded_broker import EmbeddedBroker


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: all held open together while they are chosen. One free_port()
    after another may return the same port twice (each is closed before the next bind)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(n):
            sock = held.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


class BrokerInfo:
    def __init__(self, url: str, protocol: str):
        self.url = url
        self.protocol = protocol
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname, parsed.port or 1883

    def client(self, client_id: str = "") -> mqtt.Client:
        # The console's own factory: MQTT_CA_FILE and the credentials apply here too.
        target = broker_target(self.url, protocol=self.protocol)
        client = mqtt_client(target=target, client_id=client_id)
        connected = threading.Event()
        client.on_connect = lambda c, u, f, rc, p: connected.set()
        client.connect(target.host, target.port)
        client.loop_start()
        assert connected.wait(10), f"could not connect to {self.url}"
        return client


@pytest.fixture(scope="session")
def broker() -> Iterator[BrokerInfo]:
    configured = settings.MQTT_URL
    if configured:
        yield BrokerInfo(configured, settings.MQTT_PROTOCOL)
        return
    embedded = EmbeddedBroker(port=free_port())
    embedded.start()
    try:
        yield BrokerInfo(embedded.url, "3.1.1")
    finally:
        embedded.stop()


@pytest.fixture
def mqtt_settings(settings, broker):
    """Point the console at the test broker with a topic prefix of this test's own."""
    settings.MQTT_URL = broker.url
    settings.MQTT_PROTOCOL = broker.protocol
    settings.MQTT_TOPIC_PREFIX = f"t{uuid.uuid4().hex[:10]}"
    settings.REACH_NODE_ID = "console"
    return settings


@pytest.fixture
def bridge(mqtt_settings):
    """A real bridge of the console on the test's broker (every module may use it)."""
    from messages.bridge import Bridge

    instance = Bridge(
        url=settings.MQTT_URL, node_id="console", prefix=settings.MQTT_TOPIC_PREFIX,
        instance=uuid.uuid4().hex[:8], protocol_version=settings.MQTT_PROTOCOL,
        heartbeat_ms=200,
    )
    instance.start()
    assert instance.wait_connected(10)
    yield instance
    instance.stop()

