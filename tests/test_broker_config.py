"""deploy/mosquitto.conf keeps a burst whole for a console that is away; Mosquitto's stock
limits do not.

Each test starts a PRIVATE Mosquitto (`mosquitto -c`) from deploy/mosquitto.conf as it is in
the repository, with only the listener (a free loopback port) and persistence_location (a
temporary directory) changed. The console's real bridge (messages.bridge.Bridge, MQTT 5, a
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
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from messages import protocol
from messages.bridge import BROKER_DROPPED_TOPIC, Bridge
from messages.models import Direction, Message
from tests.conftest import expect_real_services, stop_process
from tests.mqtt import free_port
from tests.processes import HOST, ROOT

ENABLED = os.environ.get("REACH_BROKER_CONFIG_TEST") == "1" or expect_real_services()
MOSQUITTO = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin")
pytestmark = [
    pytest.mark.skipif(not ENABLED, reason="starts private Mosquittos and sends 20,000-message "
                       "bursts: set REACH_BROKER_CONFIG_TEST=1 (CI's second run sets "
                       "REACH_EXPECT_REAL_SERVICES=1)"),
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(240),
]

CONF = ROOT / "deploy" / "mosquitto.conf"
BURST = 20_000
# The lines that make the difference; without them Mosquitto runs with its stock limits.
LIMITS = ("max_queued_messages", "max_inflight_messages", "max_queued_bytes")
STALL_S = 15  # no new row for this long: the bridge has stored all it will get


def broker_config(*, port: int, data_dir: Path, stock_limits: bool = False) -> str:
    """deploy/mosquitto.conf with only the listener and the persistence directory moved (and,
    for the stock case, the limit lines left out)."""
    out, listeners, locations = [], 0, 0
    for line in CONF.read_text(encoding="utf-8").splitlines():
        words = line.split()
        key = words[0] if words and not line.startswith("#") else ""
        if key == "listener":
            listeners += 1
            line = f"listener {port} {HOST}"
        elif key == "persistence_location":
            locations += 1
            line = f"persistence_location {data_dir}/"
        elif stock_limits and key in LIMITS:
            continue
        out.append(line)
    # The file must keep the shape this test relies on: one listener, one persistence dir.
    assert (listeners, locations) == (1, 1), (listeners, locations)
    return "\n".join(out) + "\n"


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

    def __init__(self, port: int):
        self.value: int | None = None
        self.rounds: list[float] = []  # monotonic time of each $SYS round seen
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                  client_id=f"drops-{uuid.uuid4().hex[:8]}")
        self.client.on_connect = lambda c, *a: c.subscribe(
            [(BROKER_DROPPED_TOPIC, 0), (self.UPTIME, 0)])
        self.client.on_message = self._on_message
        self.client.connect(HOST, port)
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


@contextmanager
def private_mosquitto(*, stock_limits: bool) -> Iterator[tuple[int, Path]]:
    """`mosquitto -c` on that configuration; yields its port and its log. Stopped with SIGTERM
    (by its own pid) at the end."""
    # Started as root, Mosquitto drops to its own user, which must write the directory.
    work = Path(tempfile.mkdtemp(prefix="reach-broker-config-"))
    work.chmod(0o777)
    port = free_port()
    conf = work / "mosquitto.conf"
    conf.write_text(broker_config(port=port, data_dir=work, stock_limits=stock_limits),
                    encoding="utf-8")
    conf.chmod(0o644)
    log_path = work / "mosquitto.log"
    with open(log_path, "w+b") as log:
        proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 15
            while not _port_open(port):
                assert proc.poll() is None, f"mosquitto exited: {log_path.read_text()}"
                assert time.monotonic() < deadline, "mosquitto did not listen within 15 s"
                time.sleep(0.1)
            yield port, log_path
        finally:
            stop_process(proc, 15)  # SIGINT: Mosquitto saves its persistence and exits
            shutil.rmtree(work, ignore_errors=True)


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex((HOST, port)) == 0


def publish_burst(port: int, topic: str, count: int) -> None:
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
    client.connect(HOST, port)
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


def burst_to_an_away_console(port: int, enough) -> tuple[int, float]:
    """The console's bridge subscribes (so its persistent session exists), goes away, a burst
    arrives, the bridge comes back with the same client id: the rows it stores, and when the
    broker had acknowledged the whole burst."""
    prefix = f"bc{uuid.uuid4().hex[:8]}"
    url = f"mqtt://{HOST}:{port}"

    def bridge() -> Bridge:
        return Bridge(url=url, node_id="console", prefix=prefix, instance="broker-config",
                      protocol_version="5", session_expiry_s=3600)

    topic = protocol.inbox_topic(prefix, "node-z")
    first = bridge()
    first.start()
    try:
        assert first.wait_connected(15), "the bridge did not connect to the private broker"
        # One message stored proves the session holds the subscription before the bridge goes.
        publish_burst(port, topic, 1)
        deadline = time.monotonic() + 30
        while stored_rows() < 1:
            assert time.monotonic() < deadline, "the bridge stored no probe message in 30 s"
            time.sleep(0.1)
    finally:
        first.stop()
    publish_burst(port, topic, BURST)
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
    assert MOSQUITTO, "mosquitto is not installed"
    queued = int(setting("max_queued_messages") or 0)
    assert queued >= BURST, f"max_queued_messages {queued} cannot hold a {BURST:,} burst"
    interval = int(setting("sys_interval") or 10)
    assert interval > 0, "sys_interval 0 turns off the dropped counter the console watches"
    with private_mosquitto(stock_limits=False) as (port, log_path):
        drops = DropCounter(port)
        try:
            stored, published_at = burst_to_an_away_console(port, lambda rows: rows == BURST)
            dropped = drops.as_of(published_at, interval)
        finally:
            drops.close()
        log = log_path.read_text(errors="replace")
    assert stored == BURST, f"stored {stored:,} of {BURST:,}; mosquitto log:\n{log[-3000:]}"
    assert dropped == 0
    assert "Outgoing messages are being dropped" not in log


def test_stock_limits_drop_most_of_the_burst_and_the_counter_says_so():
    """The same file less its limit lines: the loss the recommended values prevent is real,
    so the test above can fail."""
    assert MOSQUITTO, "mosquitto is not installed"
    interval = int(setting("sys_interval") or 10)
    with private_mosquitto(stock_limits=True) as (port, _log_path):
        drops = DropCounter(port)
        try:
            # Done once every message is a row or counted as dropped (or no more come).
            stored, published_at = burst_to_an_away_console(
                port, lambda rows: drops.value is not None and rows + drops.value >= BURST)
            dropped = drops.as_of(published_at, interval)
        finally:
            drops.close()
    assert stored < BURST // 2, f"stock limits kept {stored:,} of {BURST:,}"
    assert dropped > 0
    # Every message the broker acknowledged is either a row or in the broker's dropped count.
    assert stored + dropped == BURST, (stored, dropped)
