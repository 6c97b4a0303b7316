"""The console's own outages are not the agents' fault (PROTOCOL.md, "Outbound state
machine"): while no bridge hears the bus nothing lapses, goes stale or times out, and once
one hears again every agent gets a full lease TTL."""

from __future__ import annotations

import pytest
from django.conf import settings

from directory.resolver import resolve_agent_node
from messages.models import Message, Status
from messages.outbound import SendRequest, message_send
from messages.sweeps import deliveries_sweep
from roster import services
from roster.hearing import Hearing, bus_hearing, hearing_lost, hearing_record
from roster.models import Agent
from tests.conftest import bridge_hears, bus_heard, later, register

pytestmark = pytest.mark.django_db
TTL = settings.REACH_LEASE_TTL_MS


def test_no_lease_lapses_while_no_bridge_hears_the_bus(now):
    register("fin.tax", "node-b", now=now)
    assert services.leases_expire(now=later(now, 10 * TTL)) == services.ExpiryCounts(0, 0)
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.ONLINE


def test_after_hearing_again_every_agent_gets_one_full_ttl(now):
    register("fin.tax", "node-b", now=now)
    back = later(now, 5 * TTL)  # the console was deaf for five TTLs
    bus_heard(since=back, until=later(back, 2 * TTL))
    assert services.leases_expire(now=later(back, TTL - 1)) == services.ExpiryCounts(0, 0)
    assert services.leases_expire(now=later(back, TTL + 1)) == services.ExpiryCounts(1, 0)


def test_one_bridges_period_is_what_it_reports(now):
    hearing_record(instance="b1", since=now, through=later(now, 1000))
    assert bus_hearing(now=later(now, 1500)) == Hearing(since=now, through=later(now, 1000))
    hearing_record(instance="b1", since=later(now, 10_000), through=later(now, 10_500))
    assert bus_hearing(now=later(now, 11_000)).since == later(now, 10_000)
    hearing_lost(instance="b1")
    assert bus_hearing(now=later(now, 11_000)) is None


def test_the_proof_never_runs_ahead_of_now(now):
    bus_heard(since=now, until=later(now, 60_000))
    assert bus_hearing(now=later(now, 5000)).through == later(now, 5000)


def test_overlapping_bridges_are_one_stretch_and_an_old_one_does_not_lengthen_it(now):
    bus_heard(since=now, until=later(now, 60_000), instance="b1")
    bus_heard(since=later(now, 30_000), until=later(now, 60_000), instance="b2")
    assert bus_hearing(now=later(now, 60_000)).since == now
    # b1 stopped at 60 s; b2 alone goes on after a break of its own: the stretch is b2's.
    bus_heard(since=later(now, 90_000), until=later(now, 120_000), instance="b2")
    assert bus_hearing(now=later(now, 120_000)) == Hearing(since=later(now, 90_000),
                                                          through=later(now, 120_000))
    # Nobody heard the half second between b1's last proof and b2's first: no one stretch.
    bus_heard(since=later(now, 0), until=later(now, 60_000), instance="b1")
    bus_heard(since=later(now, 60_500), until=later(now, 120_000), instance="b2")
    assert bus_hearing(now=later(now, 120_000)).since == later(now, 60_500)


def test_silence_is_judged_at_the_proof_not_at_the_clock(now):
    """A broker connection that stalls: the proof stops at `stalled`, the wall clock goes
    on. Nothing the console could not have heard is blamed, however late it is now."""
    register("fin.tax", "node-b", now=now)  # heard at `now`, lease to now + TTL
    stalled = later(now, TTL - 500)
    bus_heard(since=later(now, -10 * TTL), until=stalled)
    wall = later(now, 10 * TTL)
    assert services.leases_expire(now=wall) == services.ExpiryCounts(0, 0)
    # Stale by then (two heartbeats missed while it heard), and said in heard time.
    words = resolve_agent_node(to_agent_id="fin.tax", now=wall).reason
    assert f"stale: no heartbeat for {(TTL - 500) // 1000} s" in words
    bus_heard(since=later(now, -10 * TTL), until=later(now, TTL + 1))  # heard past its lease
    assert services.leases_expire(now=wall) == services.ExpiryCounts(1, 0)


def test_an_agent_gets_its_whole_window_counted_from_when_hearing_began(now):
    """The worker restarted: the agent's last heartbeat is from before, hearing began again
    at `back`. Stale only after two heartbeat intervals of hearing, not of the clock."""
    beat = settings.REACH_HEARTBEAT_MS
    register("fin.tax", "node-b", now=now)
    back = later(now, 1.5 * beat)
    bus_heard(since=back, until=later(back, 2 * beat - 100))
    assert resolve_agent_node(to_agent_id="fin.tax", now=later(back, 2 * beat)).ok
    bus_heard(since=back, until=later(back, 2 * beat + 100))
    words = resolve_agent_node(to_agent_id="fin.tax", now=later(back, 2 * beat + 100)).reason
    assert "stale: no heartbeat for" in words


def test_an_agent_unheard_during_the_consoles_outage_is_not_stale(now):
    register("fin.tax", "node-b", now=now)
    moment = later(now, 2.5 * settings.REACH_HEARTBEAT_MS)  # two beats missed, lease valid
    assert resolve_agent_node(to_agent_id="fin.tax", now=moment).ok
    bus_heard(since=later(now, -TTL), until=moment)  # heard all along: the agent is silent
    words = resolve_agent_node(to_agent_id="fin.tax", now=moment).reason
    assert "stale: no heartbeat for" in words


def test_silence_is_not_judged_while_the_console_is_deaf(now):
    register("fin.tax", "node-b", now=now)
    row = message_send(request=SendRequest(to="fin.tax", timeout_ms=600_000), now=now)
    Message.objects.filter(pk=row.pk).update(status=Status.PUBLISHED, publish_at=None,
                                             ack_deadline_at=later(now, 100))
    deliveries_sweep(now=later(now, 60_000))
    row.refresh_from_db()
    assert (row.status, row.attempt) == (Status.PUBLISHED, 1)
    bus_heard(since=now, until=later(now, 60_000))
    deliveries_sweep(now=later(now, 60_000))
    row.refresh_from_db()
    assert row.status == Status.RETRYING


def test_readiness_says_when_no_bridge_hears_the_bus(client):
    answer = client.get("/readyz")
    assert answer.status_code == 503
    assert answer.json()["checks"]["broker"]["detail"].startswith(
        "no MQTT bridge hears the bus")
    bridge_hears("reach-console-1")
    answer = client.get("/readyz")
    assert answer.status_code == 200
    assert answer.json()["checks"]["broker"]["detail"] == (
        "1 bridge(s) hear the bus: reach-console-1")


def test_a_deadline_that_passes_while_deaf_ends_the_row_without_blaming_the_agent(now):
    register("fin.tax", "node-b", now=now)
    row = message_send(request=SendRequest(to="fin.tax", timeout_ms=5000), now=now)
    Message.objects.filter(pk=row.pk).update(status=Status.ACKED, publish_at=None)
    deliveries_sweep(now=later(now, 6000))  # no bridge hears
    row.refresh_from_db()
    assert row.status == Status.EXPIRED
    assert row.error == ("acknowledged, no response within 5000 ms; the console could not "
                         "hear the bus meanwhile, so the answer may only be late (a late "
                         "response still completes it)")


def test_a_deadline_after_the_proof_ends_the_row_with_the_words_of_deafness(now):
    """A stalled connection: the proof stops before the deadline, the clock passes it."""
    register("fin.tax", "node-b", now=now)
    row = message_send(request=SendRequest(to="fin.tax", timeout_ms=5000), now=now)
    Message.objects.filter(pk=row.pk).update(status=Status.ACKED, publish_at=None)
    bus_heard(since=later(now, -60_000), until=later(now, 2000))
    deliveries_sweep(now=later(now, 6000))
    row.refresh_from_db()
    assert row.status == Status.EXPIRED
    assert "the console could not hear the bus meanwhile" in row.error


def test_a_console_without_a_bridge_can_judge_by_the_clock(now, settings):
    settings.REACH_JUDGE_BY_CLOCK = True
    register("fin.tax", "node-b", now=now)
    assert services.leases_expire(now=later(now, TTL + 1)) == services.ExpiryCounts(1, 0)
