"""`/readyz`: 503 with the reason when the console cannot deliver (PROTOCOL.md "Console
pages and operations"), 200 when it can again; a load balancer never trusts a console that
cannot deliver."""

from __future__ import annotations

import shutil
import time
import uuid

import pytest
from django.conf import settings

from messages.bridge import Bridge
from messages.models import Message, Status
from messages.outbound import SendRequest, messages_send
from reachconsole.core.metrics import delivery_add_later, metrics_flush
from tests.conftest import bridge_hears, expect_real_services, register
from tests.test_bridge import EmbeddedBrokerProcess, PrivateMosquitto, eventually
from tests.test_metrics import metrics, value

pytestmark = pytest.mark.django_db(transaction=True)


def ready(client) -> tuple[int, dict]:
    answer = client.get("/readyz")
    return answer.status_code, answer.json()


def test_it_answers_in_the_shape_protocol_md_gives(client):
    bridge_hears("reach-console-1")
    status, body = ready(client)
    assert status == 200
    assert body["status"] == "ready"
    assert {"database", "redis", "broker", "delivery"} <= set(body["checks"])
    assert body["deliveryRate"] == {"min10s": None}  # no traffic
    assert body["checks"]["delivery"]["threshold"] == settings.REACH_READY_MIN_DELIVERY_RATE
    assert "reason" not in body


def test_readiness_follows_a_private_broker_down_and_back(client, mqtt_settings, tmp_path,
                                                          settings):
    """The console's bridge on a Mosquitto of the test's own: stopped, the console is not
    ready and says why; started again, the bridge reconnects and the console is ready."""
    if shutil.which("mosquitto"):
        broker, protocol_version = PrivateMosquitto(tmp_path), "5"
    elif expect_real_services():
        pytest.fail("REACH_EXPECT_REAL_SERVICES=1 but there is no mosquitto binary")
    else:
        broker, protocol_version = EmbeddedBrokerProcess(), "3.1.1"
    broker.start()
    settings.MQTT_URL, settings.MQTT_PROTOCOL = broker.url, protocol_version
    settings.REACH_BRIDGE_INSTANCE = f"ready-{uuid.uuid4().hex[:6]}"
    bridge = Bridge.from_settings()
    bridge.start()
    try:
        eventually(lambda: ready(client)[0] == 200, 20, "ready with the broker up")
        before = metrics(client)

        broker.stop()
        status, body = eventually(lambda: (r := ready(client))[0] == 503 and r, 20,
                                  "not ready once the broker stopped")
        assert body["status"] == "not ready"
        assert body["checks"]["broker"]["ok"] is False
        assert body["reason"].startswith("broker: no MQTT bridge hears the bus")
        assert body["checks"]["database"]["ok"] is True

        broker.start()
        status, body = eventually(lambda: (r := ready(client))[0] == 200 and r, 40,
                                  "ready again once the broker is back")
        assert body["checks"]["broker"]["detail"] == (
            f"1 bridge(s) hear the bus: {bridge.client_id}")
        after = eventually(
            lambda: (m := metrics(client)) and value(m, "reach_bridge_reconnects_total",
                                                     instance=bridge.client_id)
            > value(before, "reach_bridge_reconnects_total", instance=bridge.client_id) and m,
            what="the reconnection counted")
        assert value(after, "reach_bridge_reconnects_total", instance=bridge.client_id) - value(
            before, "reach_bridge_reconnects_total", instance=bridge.client_id) == 1
        assert value(after, "reach_bridge_connected", instance=bridge.client_id) == 1
    finally:
        bridge.stop()
        broker.stop()


def test_unanswered_transmissions_make_the_console_not_ready(client, mqtt_settings, settings):
    """The broker takes every request, but no node answers: the delivery rate is 0 and the
    console is not ready, with the words and the rate."""
    settings.REACH_ACK_TIMEOUT_MS = 300
    settings.REACH_READY_MIN_TRANSMISSIONS = 5
    bridge = Bridge.from_settings()
    bridge.start()
    try:
        assert bridge.wait_connected(10)
        eventually(lambda: ready(client)[0] == 200, 20, "ready before the traffic")
        register("fin.silent", "node-nobody-listens", max_inflight=100)
        rows = messages_send(requests=[SendRequest(to="fin.silent", payload={"i": i})
                                       for i in range(30)]).rows
        eventually(lambda: Message.objects.filter(pk__in=[r.pk for r in rows],
                                                  status=Status.PUBLISHED).count() == 30,
                   what="the broker taking the requests")
        metrics_flush()
        # Every second of the burst judged (1.3 s after it ended: the ACK timeout and a flush).
        status, body = eventually(
            lambda: ((r := ready(client))[0] == 503
                     and r[1]["checks"]["delivery"]["published"] == 30 and r), 15,
            "not ready while nothing is answered")
    finally:
        bridge.stop()
    assert body["deliveryRate"]["min10s"] == 0.0
    delivery = body["checks"]["delivery"]
    assert delivery["ok"] is False and delivery["published"] == 30 and delivery["answered"] == 0
    assert body["reason"].startswith("delivery: receivers answered only 0% of the task requests")
    assert body["checks"]["broker"]["ok"] is True  # the broker is fine; delivery is not


def test_a_low_rate_is_judged_only_with_enough_traffic_and_a_threshold(client, settings):
    bridge_hears("reach-console-1")
    second = int(time.time()) - 5
    settings.REACH_ACK_TIMEOUT_MS = 1000
    settings.REACH_READY_MIN_TRANSMISSIONS = 5
    delivery_add_later(published={second: 4}, answered={second: 1})
    metrics_flush()
    status, body = ready(client)
    # One second with a quarter answered, but four transmissions are too few to judge.
    assert (status, body["deliveryRate"]["min10s"]) == (200, 0.25)
    delivery_add_later(published={second + 1: 10}, answered={second + 1: 6})
    metrics_flush()
    status, body = ready(client)
    assert (status, body["deliveryRate"]["min10s"]) == (200, 0.25)  # 60 % ≥ 50 %
    settings.REACH_READY_MIN_DELIVERY_RATE = 0.7
    status, body = ready(client)
    assert status == 503 and body["checks"]["delivery"]["threshold"] == 0.7
    settings.REACH_READY_MIN_DELIVERY_RATE = 0  # the check turned off
    assert ready(client)[0] == 200
