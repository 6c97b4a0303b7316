"""What the broker cannot do is found out, not assumed: the bridge records what the CONNACK
and the `$SYS` tree told it (messages/broker_caps.py), says each limitation once in the log,
and the overview shows it.

Runs against whatever broker the suite uses: the embedded broker (MQTT 3.1.1), Mosquitto
(MQTT 5), and in CI's broker matrix NATS and RabbitMQ (MQTT 3.1.1, .ci/run)."""

from __future__ import annotations

import html
import logging

import pytest
from django.conf import settings
from django.core.cache import cache
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from messages.broker_caps import (
    CAPS_KEY,
    EMBEDDED_WORDS,
    LIMITS,
    broker_caps_read,
    broker_caps_record,
    connack_caps,
    limitations,
)
from tests.conftest import logged_in, reader
from tests.test_bridge import eventually

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fresh_record():
    cache.delete(CAPS_KEY)
    yield
    cache.delete(CAPS_KEY)


def test_it_reads_shared_subscriptions_and_session_expiry_from_the_connack():
    props = Properties(PacketTypes.CONNACK)
    assert connack_caps(v5=True, properties=props, requested_expiry_s=3600) == {
        "mqtt5": True, "shared_subscriptions": True, "session_expiry": 3600,
        "subscription_identifiers": True}
    props.SubscriptionIdentifierAvailable = 0
    assert connack_caps(v5=True, properties=props, requested_expiry_s=3600)[
        "subscription_identifiers"] is False
    props.SharedSubscriptionAvailable = 0
    props.SessionExpiryInterval = 60  # the broker lowered what we asked for
    # Without shares nothing needs identifiers: not said as a limitation.
    assert connack_caps(v5=True, properties=props, requested_expiry_s=3600) == {
        "mqtt5": True, "shared_subscriptions": False, "session_expiry": 60,
        "subscription_identifiers": None}
    assert connack_caps(v5=False, properties=None, requested_expiry_s=3600) == {
        "mqtt5": False, "shared_subscriptions": False, "session_expiry": None,
        "subscription_identifiers": None}


def test_each_limitation_is_logged_once_per_bridge(caplog):
    caplog.set_level(logging.INFO, logger="messages.broker_caps")
    for _ in range(3):
        broker_caps_record(instance="b1", url="mqtt://x:1", protocol="3.1.1", connected=True,
                           **connack_caps(v5=False, properties=None, requested_expiry_s=0))
        broker_caps_record(instance="b1", sys_drops=False)
    said = [r.getMessage() for r in caplog.records]
    # Each once; identifiers are no limitation without shares.
    expected = {words for key, words in LIMITS.items() if key != "subscription_identifiers"}
    assert len(said) == 3, said
    assert {s.split(": ", 1)[1] for s in said} == expected
    (entry,) = broker_caps_read()
    assert entry["instance"] == "b1" and set(entry["limits"]) == expected


def test_make_runs_embedded_broker_says_its_limits_once_as_information(caplog, settings):
    """A newcomer's first `make run` shows no warnings about the broker it started itself,
    and the overview one calm line instead of a list of what it cannot do."""
    settings.REACH_EMBEDDED_BROKER = True  # as runconsole sets it
    caplog.set_level(logging.INFO, logger="messages.broker_caps")
    for _ in range(3):
        broker_caps_record(instance="b3", url="mqtt://127.0.0.1:1883", protocol="3.1.1",
                           connected=True,
                           **connack_caps(v5=False, properties=None, requested_expiry_s=0))
        broker_caps_record(instance="b3", sys_drops=False)
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [(logging.INFO, "MQTT broker mqtt://127.0.0.1:1883 is make run's embedded "
                     f"one: {EMBEDDED_WORDS}. Expected here; production runs Mosquitto or "
                     "EMQX (deploy/README.md)")]
    viewer = logged_in(reader("embedded-viewer"))
    page = viewer.get("/overview/").content.decode()
    assert "data-broker-embedded" in page and "data-broker-limit" not in page


def test_a_connection_error_is_logged_once_until_it_changes(caplog):
    caplog.set_level(logging.INFO, logger="messages.broker_caps")
    for _ in range(3):
        broker_caps_record(instance="b2", connected=False, error="wrong password")
    broker_caps_record(instance="b2", connected=False, error="broker down")
    broker_caps_record(instance="b2", connected=True, error="")
    broker_caps_record(instance="b2", connected=False, error="wrong password")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["MQTT bridge b2 cannot connect: wrong password",
                      "MQTT bridge b2 cannot connect: broker down",
                      "MQTT bridge b2 cannot connect: wrong password"]


def test_the_overview_shows_what_this_broker_cannot_do(bridge, broker):
    caps = eventually(lambda: bridge.session.caps.get("connected") and bridge.session.caps,
                      what="the bridge recording the broker's capabilities")
    if broker.protocol == "5":
        assert caps["mqtt5"] is True and caps["session_expiry"] is not None
    else:
        # MQTT 3.1.1 has neither: said, not assumed away.
        assert caps["shared_subscriptions"] is False and caps["session_expiry"] is None
        assert LIMITS["shared_subscriptions"] in limitations(caps)
    viewer = logged_in(reader("caps-viewer"))
    page = viewer.get("/overview/").content.decode()
    assert f'data-broker-caps="{bridge.client_id}"' in page
    assert f"MQTT {settings.MQTT_PROTOCOL}" in page
    for words in limitations(caps):
        assert html.escape(words) in page
    if not limitations(caps):
        assert "data-broker-limit" not in page
