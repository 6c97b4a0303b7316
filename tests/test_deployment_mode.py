"""Which services this run really uses. CI's second run must be on PostgreSQL, Redis and a
real MQTT broker; `make test` on embedded defaults. Both branches assert."""

from __future__ import annotations

import threading
import uuid

import paho.mqtt.client as mqtt
import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection

from reachconsole.celery import app as celery_app
from tests.conftest import expect_real_services


@pytest.mark.django_db
def test_it_uses_the_configured_database():
    if expect_real_services():
        assert connection.vendor == "postgresql"
    elif not settings.DATABASE_URL.startswith("sqlite"):
        pytest.skip("a DATABASE_URL was given without REACH_EXPECT_REAL_SERVICES")
    else:
        assert connection.vendor == "sqlite"


def test_it_round_trips_through_the_channel_layer():
    layer = get_channel_layer()
    if expect_real_services():
        from channels_redis.pubsub import RedisPubSubChannelLayer

        assert isinstance(layer, RedisPubSubChannelLayer)
        assert celery_app.conf.broker_url.startswith("redis://")
    group = f"probe-{uuid.uuid4().hex[:8]}"

    async def round_trip():
        channel = await layer.new_channel()
        await layer.group_add(group, channel)
        await layer.group_send(group, {"type": "probe.event", "n": 1})
        message = await layer.receive(channel)
        await layer.group_discard(group, channel)
        return message

    assert async_to_sync(round_trip)() == {"type": "probe.event", "n": 1}


def test_it_reaches_the_configured_mqtt_broker():
    if not expect_real_services():
        assert settings.MQTT_URL is None  # embedded: the broker starts with the console
        return
    from urllib.parse import urlparse

    url = urlparse(settings.MQTT_URL)
    topic = f"reach-test/{uuid.uuid4().hex}"
    got = threading.Event()
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    sub.on_message = lambda c, u, m: got.set() if m.payload == b"ping" else None
    sub.connect(url.hostname, url.port or 1883)
    sub.subscribe(topic, qos=1)
    sub.loop_start()
    try:
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        pub.connect(url.hostname, url.port or 1883)
        pub.loop_start()
        pub.publish(topic, b"ping", qos=1).wait_for_publish(5)
        assert got.wait(5)
        pub.loop_stop()
        pub.disconnect()
    finally:
        sub.loop_stop()
        sub.disconnect()
