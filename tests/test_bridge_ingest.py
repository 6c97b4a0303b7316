"""How a bridge splits the inbound topics with the console's other bridges
(messages/subscriptions.py, messages/ingest_lock.py). The processes themselves, two of
everything on real services, are in tests/test_topology.py."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import pytest
from django.db import connection, connections
from django.utils import timezone

from messages.bridge import Bridge
from messages.ingest_lock import Hold, IngestLock
from messages.probes import Probe, ProbeChain
from messages.subscriptions import BROKER_DROPPED_TOPIC, IngestPlan


def bridge(**kwargs) -> Bridge:
    return Bridge(url="mqtt://127.0.0.1:1", node_id="console", prefix="p", instance="t",
                  share_group="reach-g", console_id="rc", **kwargs)


def plan(*, monitor: bool = True, setting: str = "auto", v5: bool = True, caps=None,
         lock_held: bool = False) -> IngestPlan:
    """The subscriptions of the bridge above, decided as on a CONNACK with `caps`."""
    p = IngestPlan(prefix="p", node_id="console", monitor=monitor, share_group="reach-g",
                   probe_topic=PROBE[0], setting=setting, v5=v5, caps=dict(caps or {}))
    p.decide(lock_held=lock_held)
    return p


# Each bridge's own, in every mode: the probe that proves it hears (roster/hearing.py).
PROBE = ("p/console/rc-console-t/probe", 0)


def test_it_shares_the_inbound_topics_on_an_mqtt5_broker():
    b = plan()
    assert b.mode == "shared"
    assert b.subscriptions() == [
        (BROKER_DROPPED_TOPIC, 0),  # each bridge's own: it computes drops from its last total
        PROBE,
        ("$share/reach-g/p/node/+/inbox", 1),
        ("p/heartbeat/+", 0),  # every bridge hears every heartbeat: none lost with a member
    ]
    # Plain too, in a SUBSCRIBE of its own that marks its copies: survives a broker restart.
    assert b.plain_inbox() == "p/node/console/inbox"
    # What an earlier single-mode run of this session may have left, the shared heartbeat
    # filter of an earlier version, and the own inbox's share of a run without monitor.
    assert b.stale_filters() == ["p/node/+/inbox", "$share/reach-g/p/heartbeat/+",
                                  "$share/reach-g/p/node/console/inbox"]


def test_a_broker_without_subscription_identifiers_hears_the_own_inbox_once():
    """No way to tell a plain copy from the group's: no plain subscription, and one an
    earlier run left is dropped."""
    b = plan(caps={"shared_subscriptions": True, "subscription_identifiers": False})
    assert b.plain_inbox() == ""
    assert "p/node/console/inbox" in b.stale_filters()


def test_without_monitor_only_the_own_inbox_is_shared_and_every_heartbeat_heard():
    b = plan(monitor=False)
    assert b.subscriptions() == [(BROKER_DROPPED_TOPIC, 0), PROBE,
                                 ("$share/reach-g/p/node/console/inbox", 1),
                                 ("p/heartbeat/+", 0)]
    assert b.plain_inbox() == "p/node/console/inbox"
    # A monitoring run's filters go: through them the own inbox would come twice more.
    assert b.stale_filters() == ["$share/reach-g/p/heartbeat/+", "$share/reach-g/p/node/+/inbox",
                                 "p/node/+/inbox"]


@pytest.mark.parametrize("kwargs", [
    {"v5": False},  # MQTT 3.1.1
    {"caps": {"shared_subscriptions": False}},  # CONNACK SharedSubscriptionAvailable = 0
    {"setting": "single"},
])
def test_a_broker_without_shares_gets_one_bridge_that_waits_for_the_lock(kwargs):
    b = plan(**kwargs)
    assert b.mode == "single"
    assert not b.ingesting  # no lock yet: standby
    assert b.subscriptions() == [(BROKER_DROPPED_TOPIC, 0), PROBE]
    # Before this connection has asked for the lock, nothing inbound is dropped: the session
    # may hold what the broker kept for it, and it may be the one to take the lock.
    assert "p/node/+/inbox" not in b.stale_filters()
    b.lock_asked = True  # asked, and another bridge holds it: a standby drops the inbox
    assert "p/node/+/inbox" in b.stale_filters()
    b.ingesting = True  # holds the lock
    assert b.subscriptions() == [(BROKER_DROPPED_TOPIC, 0), PROBE, ("p/heartbeat/+", 0),
                                 ("p/node/+/inbox", 1)]
    assert "p/node/+/inbox" not in b.stale_filters()


def test_a_bridge_holding_the_lock_when_the_mode_is_decided_ingests_at_once():
    assert plan(setting="single", lock_held=True).ingesting
    assert plan(lock_held=False).ingesting  # shared: every bridge takes its share


def test_a_refused_shared_subscription_turns_the_bridge_to_single_mode(caplog):
    from paho.mqtt.reasoncodes import ReasonCode

    caplog.set_level(logging.INFO, logger="messages.mqtt_session")
    b = bridge()
    b.session._ingest_mode_decide()
    refused = ReasonCode(packetType=9, identifier=0x9E)  # SUBACK: shared subs not supported
    b.session._on_subscribe(None, None, 1, [refused], None)
    assert b.session.ingest_mode == "single"
    assert "one active bridge (the broker refused a shared subscription)" in caplog.text


def test_an_unknown_ingest_setting_is_refused_with_words():
    with pytest.raises(ValueError, match="ingest 'both': use one of auto, shared, single"):
        bridge(ingest="both")
    assert bridge().session.probe_topic == PROBE[0]  # the plan above is this bridge's


@pytest.mark.django_db(transaction=True)
def test_one_bridge_at_a_time_holds_the_ingest_lock():
    first, second = IngestLock(name="test-lock"), IngestLock(name="test-lock")
    try:
        if connection.vendor != "postgresql":
            # The embedded mode is one process: the lock is always held.
            assert first.hold() is Hold.HELD and second.hold() is Hold.HELD
            return
        assert first.hold() is Hold.HELD
        assert second.hold() is Hold.NOT_HELD
        assert first.hold() is Hold.HELD  # still held: checked with a round trip
        first.release()
        assert second.hold() is Hold.HELD
        assert first.hold() is Hold.NOT_HELD
    finally:
        first.release()
        second.release()


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql",
                    reason="the lock is PostgreSQL's; SQLite runs one process and always holds it")
def test_a_holder_whose_session_ended_takes_the_lock_again_at_once():
    """A PostgreSQL restart ends the lock's session; the database answers again before the
    next check. The holder must take the lock again in that same check and keep ingesting:
    standing by for a turn unsubscribed the inbound topics for a second, and the soak lost
    the 312 observed messages published in it. Taken by another meanwhile, it stands by."""
    lock, other = IngestLock(name="retake"), IngestLock(name="retake")
    try:
        assert lock.hold() is Hold.HELD
        ended = lock._conn.info.backend_pid
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [ended])
        assert _lock_turn(bridge(ingest="single"), lock), "it stood by between two sessions"
        assert lock._conn is not None and lock._conn.info.backend_pid != ended
        assert other.hold() is Hold.NOT_HELD  # one holder still

        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [lock._conn.info.backend_pid])
        assert other.hold() is Hold.HELD  # another bridge was quicker this time
        assert not _lock_turn(bridge(ingest="single"), lock), "two bridges ingest"
    finally:
        lock.release()
        other.release()


@contextmanager
def _database_away():
    """A database alias for the default database on a port where nothing listens: its
    connections (the ORM's and the lock's own) are refused, as in an outage."""
    from tests.mqtt import free_port

    alias = f"away-{free_port()}"
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


def _lock_turn(b: Bridge, lock: IngestLock) -> bool:
    """One turn of the ingest lock of a single-mode bridge that was ingesting: whether it
    still ingests after it."""
    b.session._ingest_mode_decide()
    b.session.ingest_lock = lock
    b.session.connected.set()
    b.session.plan.lock_asked, b.session.plan.ingesting = True, True
    b.session.lock_turn(time.monotonic() + 10)
    return b.session.plan.ingesting


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
        lock = IngestLock(name="outage", alias=away)
        assert lock.hold() is Hold.UNKNOWN and lock.unreachable
        assert _lock_turn(bridge(ingest="single"), lock), "it stood by during the outage"

    with django_db_blocker.unblock():
        lock = IngestLock(name="refused")
        real, dead = lock._params, free_port()
        lock._params = lambda: {**real(), "port": dead}  # the lock's connection alone refused
        try:
            assert lock.hold() is Hold.NOT_HELD and lock.unreachable
            assert not _lock_turn(bridge(ingest="single"), lock), (
                "it went on ingesting without the lock")
        finally:
            lock.release()


def test_the_chain_of_probes_breaks_on_a_missing_one_and_trusts_only_its_own():
    """roster/hearing.py: the send times are the chain's own record; a probe missing (a
    QoS 0 drop: heartbeats may have gone too) starts a new period; a probe it did not send,
    or sent before the broker granted its current subscriptions, proves nothing."""
    chain = ProbeChain()
    assert chain.heard is None
    chain.renew()
    now = chain.nonce
    t0 = timezone.now()
    chain.send(), chain.send()
    t1 = timezone.now()
    chain.send()
    t2 = timezone.now()
    chain.send()
    t3 = timezone.now()
    chain.back([Probe(now, 1), Probe(now, 2)])
    since, through = chain.heard
    assert t0 <= since <= through <= t1
    chain.back([Probe(now, 9), Probe("forged", 3), Probe("forged", 4)])
    assert chain.heard == (since, through)  # forged, or never sent: nothing
    chain.back([Probe(now, 4)])  # 3 never came back: a new period from 4
    since4, through4 = chain.heard
    assert t2 <= since4 == through4 <= t3
    chain.renew()  # the broker granted the subscriptions again: what came before proves nothing
    assert chain.heard is None
    chain.back([Probe(now, 3)])
    assert chain.heard is None
