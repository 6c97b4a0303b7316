"""Observed traffic across a broker restart, in each ingest mode (README, "Sharing the inbound
load between bridges"). Mosquitto restores a persistent session's plain subscriptions from
its persistence but not its shared ones: with one ingesting bridge (`REACH_BRIDGE_INGEST=
single`) what a node publishes after the broker is back and before the bridge has connected
again is queued for the bridge's session and stored; with shared ingest it matches no
subscriber and is gone (Mosquitto 2.0: should a version restore shared subscriptions, the
README's advice changes with this test). A real bridge on a private, persistent Mosquitto;
the gap is made wide on purpose (the bridge's reconnect delay), where in production it is
the race between the bridge's reconnect and the publishers'."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from messages import protocol
from messages.bridge import Bridge
from messages.models import Direction, Message
from tests.conftest import expect_real_services, stop_process
from tests.mqtt import free_port
from tests.test_bridge import _port_open, eventually

pytestmark = [
    pytest.mark.skipif(not (shutil.which("mosquitto") or expect_real_services()),
                       reason="starts a private Mosquitto: it is not installed"),
    pytest.mark.timeout(120),
]
PREFIX = "ooder"
MT = protocol.MessageType


class PersistentMosquitto:
    """A Mosquitto of this test's own, with persistence, as deploy/ runs it: stopped with
    SIGINT it saves its sessions (and their plain subscriptions) and restores them."""

    def __init__(self):
        self.port = free_port()
        self.url = f"mqtt://127.0.0.1:{self.port}"
        # As root, Mosquitto drops to its own user, which must reach and write this (pytest's
        # tmp_path sits under a directory only root may enter).
        self.work = work = Path(tempfile.mkdtemp(prefix="reach-observed-broker-"))
        work.chmod(0o777)
        self.conf = work / "mosquitto.conf"
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
            f"persistence_location {work}/\nmax_queued_messages 100000\n", encoding="utf-8")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["mosquitto", "-c", str(self.conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        eventually(lambda: _port_open(self.port), 10, "mosquitto listening")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 15)  # SIGINT: it writes its persistence and exits

    def remove(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def _observed(n: int) -> list[protocol.Envelope]:
    """Requests between two other nodes: the console only watches them."""
    return [protocol.new_envelope(
        message_type=MT.TASK_REQUEST, from_agent_id="fin.tax", to_agent_id="hr.pay",
        target_node_id="node-x", task_id=f"obs-{uuid.uuid4().hex}",
        headers={"replyNodeId": "node-y", "originNodeId": "node-y"}, payload={"i": i})
        for i in range(n)]


def _publish_all(url_port: int, envs: list[protocol.Envelope]) -> None:
    """From a node's client of its own, each at QoS 1 and acknowledged by the broker."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"node-y-{uuid.uuid4().hex}",
                         protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", url_port)
    client.loop_start()
    try:
        topic = protocol.inbox_topic(PREFIX, "node-x")
        for info in [client.publish(topic, protocol.encode(e), qos=1) for e in envs]:
            info.wait_for_publish(10)
            assert info.rc == mqtt.MQTT_ERR_SUCCESS and info.is_published()
    finally:
        client.disconnect()
        client.loop_stop()


def _stored(envs: list[protocol.Envelope]) -> int:
    return Message.objects.filter(message_id__in=[e.message_id for e in envs],
                                  direction=Direction.OBSERVED).count()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("ingest", "kept"), [("single", 200), ("shared", 0)])
def test_what_a_node_publishes_before_the_bridge_is_back_is_kept_by_a_plain_subscription(
        settings, ingest, kept):
    settings.MQTT_TOPIC_PREFIX = PREFIX
    broker = PersistentMosquitto()
    bridge = Bridge(url=broker.url, node_id="console", prefix=PREFIX,
                    instance=f"obs-{uuid.uuid4().hex[:6]}", protocol_version="5",
                    heartbeat_ms=60_000, ingest=ingest,
                    # It comes back no sooner than 8 s after it lost the broker: the node's
                    # publishes below all fall in the gap, however slow the machine.
                    reconnect_delay_s=(8, 8))
    try:
        broker.start()
        bridge.start()
        assert bridge.wait_connected(15) and bridge.session.ingest_mode == ingest
        first = _observed(20)
        _publish_all(broker.port, first)
        eventually(lambda: _stored(first) == 20, 20, "the first 20 observed messages stored")

        broker.stop()
        lost_at = time.monotonic()
        assert (broker.work / "mosquitto.db").exists(), "the broker kept no persistence"
        time.sleep(1)
        broker.start()
        gap = _observed(200)
        _publish_all(broker.port, gap)
        assert not bridge.session.connected.is_set() and time.monotonic() - lost_at < 8, (
            "the bridge reconnected before the node's publishes; the test missed its gap")
        assert bridge.wait_connected(30), "the bridge did not come back to the broker"
        after = _observed(20)
        _publish_all(broker.port, after)
        # Everything published once the bridge is subscribed again is stored in either mode;
        # by then what its session had queued has come too (one queue, in order).
        eventually(lambda: _stored(after) == 20, 30, "the 20 published after its return")
        assert _stored(gap) == kept
        assert Message.objects.filter(direction=Direction.OBSERVED).count() == 40 + kept
    finally:
        bridge.stop()
        broker.stop()
        broker.remove()
