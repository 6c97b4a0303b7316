"""How a bridge splits the inbound topics with the console's other bridges (messages/bridge.py
"what each bridge subscribes to", messages/ingest_lock.py). The processes themselves, two of
everything on real services, are in tests/test_topology.py."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.utils import timezone

from messages.bridge import BROKER_DROPPED_TOPIC, Bridge, _Probe
from messages.ingest_lock import IngestLock


def bridge(**kwargs) -> Bridge:
    return Bridge(url="mqtt://127.0.0.1:1", node_id="console", prefix="p", instance="t",
                  share_group="reach-g", console_id="rc", **kwargs)


# Each bridge's own, in every mode: the probe that proves it hears (roster/hearing.py).
PROBE = ("p/console/rc-console-t/probe", 0)


def test_it_shares_the_inbound_topics_on_an_mqtt5_broker():
    b = bridge()
    b._ingest_mode_decide()
    assert b.ingest_mode == "shared"
    assert b._subscriptions() == [
        (BROKER_DROPPED_TOPIC, 0),  # each bridge's own: it computes drops from its last total
        PROBE,
        ("$share/reach-g/p/node/+/inbox", 1),
        ("p/heartbeat/+", 0),  # every bridge hears every heartbeat: none lost with a member
    ]
    # Plain too, in a SUBSCRIBE of its own that marks its copies: survives a broker restart.
    assert b._plain_inbox() == "p/node/console/inbox"
    # What an earlier single-mode run of this session may have left, the shared heartbeat
    # filter of an earlier version, and the own inbox's share of a run without monitor.
    assert b._stale_filters() == ["p/node/+/inbox", "$share/reach-g/p/heartbeat/+",
                                  "$share/reach-g/p/node/console/inbox"]


def test_a_broker_without_subscription_identifiers_hears_the_own_inbox_once():
    """No way to tell a plain copy from the group's: no plain subscription, and one an
    earlier run left is dropped."""
    b = bridge()
    b.caps.update({"shared_subscriptions": True, "subscription_identifiers": False})
    b._ingest_mode_decide()
    assert b._plain_inbox() == ""
    assert "p/node/console/inbox" in b._stale_filters()


def test_without_monitor_only_the_own_inbox_is_shared_and_every_heartbeat_heard():
    b = bridge(monitor=False)
    b._ingest_mode_decide()
    assert b._subscriptions() == [(BROKER_DROPPED_TOPIC, 0), PROBE,
                                  ("$share/reach-g/p/node/console/inbox", 1),
                                  ("p/heartbeat/+", 0)]
    assert b._plain_inbox() == "p/node/console/inbox"
    # A monitoring run's filters go: through them the own inbox would come twice more.
    assert b._stale_filters() == ["$share/reach-g/p/heartbeat/+", "$share/reach-g/p/node/+/inbox",
                                  "p/node/+/inbox"]


@pytest.mark.parametrize(("kwargs", "caps"), [
    ({"protocol_version": "3.1.1"}, {}),
    ({}, {"shared_subscriptions": False}),  # CONNACK SharedSubscriptionAvailable = 0
    ({"ingest": "single"}, {}),
])
def test_a_broker_without_shares_gets_one_bridge_that_waits_for_the_lock(kwargs, caps):
    b = bridge(**kwargs)
    b.caps.update(caps)
    b._ingest_mode_decide()
    assert b.ingest_mode == "single"
    assert not b._ingesting  # no lock yet: standby
    assert b._subscriptions() == [(BROKER_DROPPED_TOPIC, 0), PROBE]
    # Before this connection has asked for the lock, nothing inbound is dropped: the session
    # may hold what the broker kept for it, and it may be the one to take the lock.
    assert "p/node/+/inbox" not in b._stale_filters()
    b._lock_asked = True  # asked, and another bridge holds it: a standby drops the inbox
    assert "p/node/+/inbox" in b._stale_filters()
    b._ingesting = True  # holds the lock
    assert b._subscriptions() == [(BROKER_DROPPED_TOPIC, 0), PROBE, ("p/heartbeat/+", 0),
                                  ("p/node/+/inbox", 1)]
    assert "p/node/+/inbox" not in b._stale_filters()


def test_a_refused_shared_subscription_turns_the_bridge_to_single_mode(caplog):
    from paho.mqtt.reasoncodes import ReasonCode

    caplog.set_level(logging.INFO, logger="messages.bridge")
    b = bridge()
    b._ingest_mode_decide()
    refused = ReasonCode(packetType=9, identifier=0x9E)  # SUBACK: shared subs not supported
    b._on_subscribe(None, None, 1, [refused], None)
    assert b.ingest_mode == "single"
    assert "one active bridge (the broker refused a shared subscription)" in caplog.text


def test_an_unknown_ingest_setting_is_refused_with_words():
    with pytest.raises(ValueError, match="ingest 'both': use one of auto, shared, single"):
        bridge(ingest="both")


@pytest.mark.django_db(transaction=True)
def test_one_bridge_at_a_time_holds_the_ingest_lock():
    first, second = IngestLock(name="test-lock"), IngestLock(name="test-lock")
    try:
        if connection.vendor != "postgresql":
            # The embedded mode is one process: the lock is always held.
            assert first.hold() and second.hold()
            return
        assert first.hold()
        assert not second.hold()
        assert first.hold()  # still held: checked with a round trip
        first.release()
        assert second.hold()
        assert not first.hold()
    finally:
        first.release()
        second.release()


@contextmanager
def _database_away():
    """A database alias for the default database on a port where nothing listens: its
    connections (the ORM's and the lock's own) are refused, as in an outage."""
    from tests.mqtt import free_port

    alias = "away"
    settings_dict = {**connections.settings["default"], "PORT": str(free_port())}
    options = dict(settings_dict.get("OPTIONS") or {})
    options.pop("pool", None)  # a plain connection: a pool would wait for its timeout
    settings_dict["OPTIONS"] = options
    connections.settings[alias] = settings_dict
    try:
        yield alias
    finally:
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


@pytest.mark.skipif(connection.vendor != "postgresql",
                    reason="the lock is PostgreSQL's; SQLite runs one process and always holds it")
def test_a_database_outage_is_no_reason_to_stand_by_but_a_refused_lock_is(django_db_blocker):
    """Single mode: a bridge that cannot reach the database keeps its inbound subscriptions
    (standing by would unsubscribe, and the broker would drop what matched nobody). One whose
    lock connection alone is refused while the database answers (too many clients) is in no
    outage: it stands by, so two bridges never both ingest. (Unblocked rather than marked:
    a test case refuses a database alias made during the test, and this one reads no table.)"""
    from tests.mqtt import free_port

    with django_db_blocker.unblock(), _database_away() as away:
        b = bridge(ingest="single")
        b._ingest_mode_decide()
        b._ingest_lock = IngestLock(name=f"outage-{b.client_id}", alias=away)
        b.connected.set()
        b._lock_asked, b._ingesting = True, True
        b._ingest_lock_turn(time.monotonic() + 10)
        assert b._ingest_lock.unreachable and b._ingesting, "it stood by during the outage"

    b = bridge(ingest="single")
    b._ingest_mode_decide()
    lock = b._ingest_lock = IngestLock(name=f"refused-{b.client_id}")
    real = lock._params
    with django_db_blocker.unblock():
        _lock_refused_alone(b, lock, real, free_port())


def _lock_refused_alone(b: Bridge, lock: IngestLock, real, dead: int) -> None:
    try:
        b.connected.set()
        b._lock_asked, b._ingesting = True, True
        lock._params = lambda: {**real(), "port": dead}  # the lock's connection alone refused
        b._ingest_lock_turn(time.monotonic() + 10)
        assert lock.unreachable and not b._ingesting, "it went on ingesting without the lock"
    finally:
        lock.release()


def test_the_chain_of_probes_breaks_on_a_missing_one_and_trusts_only_its_own():
    """roster/hearing.py: the send times are the bridge's own record; a probe missing (a
    QoS 0 drop: heartbeats may have gone too) starts a new period; a probe it did not send,
    or sent before the broker granted its current subscriptions, proves nothing."""
    b = bridge()
    b._probe_nonce = "now"
    t = [timezone.now() + timedelta(seconds=i) for i in range(6)]
    b._probes_out.update({1: ("now", t[0]), 2: ("now", t[1]), 4: ("now", t[3]),
                          5: ("before", t[4])})
    b._probes_back([_Probe("now", 1), _Probe("now", 2)])
    assert b._heard[:2] == (t[0], t[1])
    b._probes_back([_Probe("now", 9), _Probe("before", 5), _Probe("now", 5)])
    assert b._heard[:2] == (t[0], t[1])  # forged, from before, or not ours: nothing
    b._probes_back([_Probe("now", 4)])  # 3 never came back
    assert b._heard[:2] == (t[3], t[3])
