"""A broker connection that stalls without closing (tests/stallproxy.py): the bridge's socket
stays open, nothing moves. Hearing is what comes back through the broker (roster/hearing.py),
so the console stops judging anyone's silence at the moment the stall began, calls the
connection dead within its keepalive, reconnects, loses nothing, and starts a new hearing
period in which every agent gets its whole window again."""

from __future__ import annotations

import logging
import shutil
import uuid
from datetime import timedelta

import paho.mqtt.client as mqtt
import pytest
from django.utils import timezone

from messages import protocol
from messages.bridge import Bridge
from messages.models import Message
from roster import services
from roster.hearing import bus_hearing
from tests.conftest import expect_real_services, register
from tests.stallproxy import StallProxy
from tests.test_bridge import EmbeddedBrokerProcess, PrivateMosquitto, eventually

pytestmark = pytest.mark.django_db(transaction=True)


def ready(client) -> int:
    return client.get("/readyz").status_code


def publish_direct(port: int, topic: str, payload: bytes, version: int) -> None:
    """As a node would: straight to the broker, not through the stalled path."""
    peer = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"peer-{uuid.uuid4().hex[:8]}",
                       protocol=version)
    peer.connect("127.0.0.1", port)
    peer.loop_start()
    try:
        peer.publish(topic, payload, qos=1).wait_for_publish(10)
    finally:
        peer.disconnect()
        peer.loop_stop()


def test_a_stall_stops_the_judging_and_the_bridge_reconnects_losing_nothing(
        client, settings, tmp_path, caplog):
    if shutil.which("mosquitto"):
        broker, version, paho_version = PrivateMosquitto(tmp_path), "5", mqtt.MQTTv5
    elif expect_real_services():
        pytest.fail("REACH_EXPECT_REAL_SERVICES=1 but there is no mosquitto binary")
    else:
        broker, version, paho_version = EmbeddedBrokerProcess(), "3.1.1", mqtt.MQTTv311
    broker.start()
    proxy = StallProxy(target_host="127.0.0.1", target_port=broker.port).start()
    settings.MQTT_URL, settings.MQTT_PROTOCOL = f"mqtt://127.0.0.1:{proxy.port}", version
    settings.MQTT_KEEPALIVE_S = 6  # longer than readiness takes to notice (3 s)
    settings.REACH_HEARTBEAT_MS, settings.REACH_LEASE_TTL_MS = 500, 2000
    settings.REACH_BRIDGE_INSTANCE = f"stall-{uuid.uuid4().hex[:6]}"
    bridge = Bridge.from_settings()
    bridge.start()
    try:
        eventually(lambda: ready(client) == 200, 20, "ready before the stall")
        generation = bridge.session.generation
        register("fin.quiet", "node-q")  # heard once, then silent (its lease: 2 s)

        with caplog.at_level(logging.ERROR, logger="messages.mqtt_session"):
            proxy.stall()
            stalled_at = timezone.now()
            # The node publishes to the broker directly throughout: kept for the session.
            message = protocol.new_envelope(message_type=protocol.MessageType.TASK_REQUEST,
                                            from_agent_id="ops.a", to_agent_id="ops.b",
                                            payload={"during": "the stall"})
            publish_direct(broker.port, protocol.inbox_topic(settings.MQTT_TOPIC_PREFIX,
                                                             "node-x"),
                           protocol.encode(message), paho_version)
            eventually(lambda: ready(client) == 503, 15, "not ready while nothing comes back")
            words = client.get("/readyz").json()["checks"]["broker"]["detail"]
            assert f"{bridge.client_id} was connected, but its probe last came back" in words
            # The proof stopped where the stall began, however long it lasts.
            assert bus_hearing().through <= stalled_at
            eventually(lambda: any("no probe came back" in r.getMessage()
                                   for r in caplog.records), 15,
                       "the bridge calling the open connection dead")
            # Its lease ended during the stall: not judged, the console could not hear.
            eventually(lambda: timezone.now() > stalled_at + timedelta(seconds=2.5),
                       5, "past the lease")
            assert services.leases_expire() == services.ExpiryCounts(0, 0)
            proxy.resume()

        eventually(lambda: ready(client) == 200, 30, "ready again once the path moves")
        assert bridge.session.generation > generation  # a new connection, not the stalled one
        eventually(lambda: Message.objects.filter(message_id=message.message_id).count() == 1,
                   20, "the message published during the stall stored, once")
        hearing = eventually(lambda: bus_hearing(), 10, "hearing again")
        assert hearing.since > stalled_at  # a new period: the stall was a gap
        # Every agent gets its whole lease again, counted from the new period ...
        assert services.leases_expire() == services.ExpiryCounts(0, 0)
        # ... and then silence is judged again.
        eventually(lambda: services.leases_expire().offline == 1, 15,
                   "the silent agent's lease lapsing once the console heard a full TTL")
    finally:
        bridge.stop()
        proxy.stop()
        broker.stop()
