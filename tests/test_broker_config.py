"""deploy/mosquitto.conf keeps a burst whole for a console that is away; Mosquitto's stock
limits do not.

Each test starts a PRIVATE Mosquitto (`mosquitto -c`) from deploy/mosquitto.conf and its ACL
as they are in the repository, with only the listener (a free loopback port), the
persistence directory and the account files moved (tests/deploy_broker.py); every client
signs in with the console's account. The console's real bridge (messages.bridge.Bridge, MQTT 5, a
persistent session; MQTT 5 shared subscriptions where the bridge uses them) connects,
subscribes and stores a probe message, then stops: its session stays on the broker while
nobody reads it. A publisher sends a 20,000-message QoS 1 burst to the inbox wildcard the
bridge monitors and gets a PUBACK for every message. A new bridge with the same client id
resumes the session, and the test counts the rows in `a2a_message` and reads Mosquitto's
`$SYS/broker/publish/messages/dropped` counter.

- With the recommended file: all 20,000 rows, and the broker dropped nothing.
- With the same file less its queue and in-flight limits (Mosquitto's stock 1,000 queued and
  20 in flight per client): most of the burst is dropped, the dropped counter says how many,
  and stored + dropped = sent.

It takes about half a minute, so it runs in CI's second run (REACH_EXPECT_REAL_SERVICES=1) or
with REACH_BROKER_CONFIG_TEST=1.
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid

import paho.mqtt.client as mqtt
import pytest

from messages import protocol
from messages.bridge import Bridge
from messages.models import Direction, Message
from messages.subscriptions import BROKER_DROPPED_TOPIC
from tests.conftest import expect_real_services
from tests.deploy_broker import CONF, CONSOLE_PASSWORD, CONSOLE_USER, Broker, private_mosquitto
from tests.processes import HOST

ENABLED = os.environ.get("REACH_BROKER_CONFIG_TEST") == "1" or expect_real_services()
pytestmark = [
    pytest.mark.skipif(not ENABLED, reason="starts private Mosquittos and sends 20,000-message "
                       "bursts: set REACH_BROKER_CONFIG_TEST=1 (CI's second run sets "
                       "REACH_EXPECT_REAL_SERVICES=1)"),
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(240),
]

BURST = 20_000
# The lines that make the difference; without them Mosquitto runs with its stock limits.
LIMITS = ("max_queued_messages", "max_inflight_messages", "max_queued_bytes")
STALL_S = 15  # no new row for this long: the bridge has stored all it will get


def setting(name: str) -> str | None:
    match = re.search(rf"^{name}\s+(\S+)\s*$", CONF.read_text(encoding="utf-8"), re.MULTILINE)
    return match.group(1) if match else None


class DropCounter:
    """Mosquitto's $SYS/broker/publish/messages/dropped, as the console's bridge reads it.

    Mosquitto republishes a $SYS value only when it changed, so the last value seen says
    nothing about when it was true. Each $SYS round starts with $SYS/broker/uptime, which
    always changes: once two rounds have begun after a moment, the round in between has
    delivered its dropped counter, and the value held is the one of that moment or later."""

    UPTIME = "$SYS/broker/uptime"

    def __init__(self, broker: Broker):
        self.value: int | None = None
        self.rounds: list[float] = []  # monotonic time of each $SYS round seen
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                  client_id=f"drops-{uuid.uuid4().hex[:8]}")
        self.client.on_connect = lambda c, *a: c.subscribe(
            [(BROKER_DROPPED_TOPIC, 0), (self.UPTIME, 0)])
        self.client.on_message = self._on_message
        self.client.username_pw_set(CONSOLE_USER, CONSOLE_PASSWORD)
        self.client.connect(HOST, broker.port)
        self.client.loop_start()

    def _on_message(self, client, userdata, message) -> None:
        if message.topic == self.UPTIME:
            self.rounds.append(time.monotonic())
        else:
            self.value = int(message.payload)

    def as_of(self, moment: float, interval_s: int) -> int:
        """The counter as Mosquitto reported it at `moment` (time.monotonic()) or later."""
        deadline = time.monotonic() + 3 * interval_s + 10
        while sum(1 for t in self.rounds if t > moment) < 2:
            assert time.monotonic() < deadline, f"no $SYS rounds after the moment ({self.rounds})"
            time.sleep(0.1)
        assert self.value is not None, f"Mosquitto published no {BROKER_DROPPED_TOPIC}"
        return self.value

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def publish_burst(broker: Broker, topic: str, count: int) -> None:
    """`count` QoS 1 messages, and a PUBACK for every one: the broker took them all."""
    acked, done = [0], threading.Event()

    def on_publish(client, userdata, mid, reason_code, properties) -> None:
        acked[0] += 1
        if acked[0] == count:
            done.set()

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                         client_id=f"burst-{uuid.uuid4().hex[:8]}")
    # No client-side window (0 = unlimited): the burst reaches the broker as fast as it can
    # take it, as from many nodes at once.
    client.max_inflight_messages_set(0)
    client.max_queued_messages_set(0)
    client.on_publish = on_publish
    client.username_pw_set(CONSOLE_USER, CONSOLE_PASSWORD)
    client.connect(HOST, broker.port)
    client.loop_start()
    try:
        for i in range(count):
            envelope = protocol.new_envelope(message_type=protocol.MessageType.EVENT,
                                             from_agent_id="fin.tax", to_agent_id="llm.chat",
                                             payload={"n": i})
            info = client.publish(topic, protocol.encode(envelope), qos=1)
            assert info.rc == mqtt.MQTT_ERR_SUCCESS, f"publish {i}: {mqtt.error_string(info.rc)}"
        assert done.wait(120), f"the broker acknowledged {acked[0]} of {count} in 120 s"
    finally:
        client.loop_stop()
        client.disconnect()


def stored_rows() -> int:
    return Message.objects.filter(direction=Direction.OBSERVED).count()


def wait_until_stored(enough) -> int:
    """Rows the bridge stores, once `enough(rows)` or it stopped getting more."""
    last, last_change = -1, time.monotonic()
    while True:
        now_rows = stored_rows()
        if enough(now_rows):
            return now_rows
        if now_rows != last:
            last, last_change = now_rows, time.monotonic()
        elif time.monotonic() - last_change > STALL_S:
            return now_rows
        time.sleep(0.25)


def burst_to_an_away_console(broker: Broker, enough) -> tuple[int, float]:
    """The console's bridge subscribes (so its persistent session exists), goes away, a burst
    arrives, the bridge comes back with the same client id: the rows it stores, and when the
    broker had acknowledged the whole burst."""
    prefix = f"bc{uuid.uuid4().hex[:8]}"
    url = broker.url()

    def bridge() -> Bridge:
        return Bridge(url=url, node_id="console", prefix=prefix, instance="broker-config",
                      protocol_version="5", session_expiry_s=3600)

    topic = protocol.inbox_topic(prefix, "node-z")
    first = bridge()
    first.start()
    try:
        assert first.wait_connected(15), "the bridge did not connect to the private broker"
        # One message stored proves the session holds the subscription before the bridge goes.
        publish_burst(broker, topic, 1)
        deadline = time.monotonic() + 30
        while stored_rows() < 1:
            assert time.monotonic() < deadline, "the bridge stored no probe message in 30 s"
            time.sleep(0.1)
    finally:
        first.stop()
    publish_burst(broker, topic, BURST)
    published_at = time.monotonic()
    assert stored_rows() == 1, "the bridge stored rows while it was stopped"
    second = bridge()
    second.start()
    try:
        assert second.wait_connected(15), "the bridge did not reconnect"
        return wait_until_stored(lambda rows: enough(rows - 1)) - 1, published_at
    finally:
        second.stop()


def test_the_recommended_configuration_keeps_a_20000_message_burst_for_an_away_console():
    queued = int(setting("max_queued_messages") or 0)
    assert queued >= BURST, f"max_queued_messages {queued} cannot hold a {BURST:,} burst"
    interval = int(setting("sys_interval") or 10)
    assert interval > 0, "sys_interval 0 turns off the dropped counter the console watches"
    with private_mosquitto() as broker:
        drops = DropCounter(broker)
        try:
            stored, published_at = burst_to_an_away_console(broker, lambda rows: rows == BURST)
            dropped = drops.as_of(published_at, interval)
        finally:
            drops.close()
        log = broker.log_path.read_text(errors="replace")
    assert stored == BURST, f"stored {stored:,} of {BURST:,}; mosquitto log:\n{log[-3000:]}"
    assert dropped == 0
    assert "Outgoing messages are being dropped" not in log


def test_stock_limits_drop_most_of_the_burst_and_the_counter_says_so():
    """The same file less its limit lines: the loss the recommended values prevent is real,
    so the test above can fail."""
    interval = int(setting("sys_interval") or 10)
    with private_mosquitto(skip=LIMITS) as broker:
        drops = DropCounter(broker)
        try:
            # Done once every message is a row or counted as dropped (or no more come).
            stored, published_at = burst_to_an_away_console(
                broker, lambda rows: drops.value is not None and rows + drops.value >= BURST)
            dropped = drops.as_of(published_at, interval)
        finally:
            drops.close()
    assert stored < BURST // 2, f"stock limits kept {stored:,} of {BURST:,}"
    assert dropped > 0
    # Every message the broker acknowledged is either a row or in the broker's dropped count.
    assert stored + dropped == BURST, (stored, dropped)
