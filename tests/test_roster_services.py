from __future__ import annotations

import threading

import pytest
from django.db import connection, connections, transaction

from reachconsole.core.audit import AuditEntry
from roster import services
from roster.errors import AgentHeldElsewhere, AgentNotFound, InvalidAgentId, InvalidField, WrongNode
from roster.models import Agent, ClusterNode, LeaseDeadline, RosterEvent
from tests.conftest import later, register, run_at_once

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]


def test_it_registers_an_agent_with_a_lease(now, settings):
    lease = services.agent_register(
        agent_id="fin/tax", node_id="node-a", capabilities=["tax", "vat"], groups=["finance"],
        max_inflight=4, metadata={"region": "eu"}, now=now,
    )
    agent = Agent.objects.get(agent_id="fin.tax")
    assert lease.created is True
    assert agent.namespace.name == "fin" and agent.name == "tax"
    assert agent.node.node_id == "node-a"
    assert agent.capabilities == ["tax", "vat"]
    assert agent.groups == ["#finance"]
    assert agent.max_inflight == 4
    assert agent.status == Agent.Status.ONLINE
    assert agent.lease_expires_at == later(now, settings.REACH_LEASE_TTL_MS)
    assert lease.lease_ttl_ms == settings.REACH_LEASE_TTL_MS
    assert RosterEvent.objects.filter(agent_id="fin.tax", kind="REGISTERED").count() == 1


def test_it_defaults_the_capability_to_the_name_segment():
    agent = register("llm.bank-statement")
    assert agent.capabilities == ["bank-statement"]
    assert agent.capability_segment == "bank-statement"


def test_it_is_idempotent_for_the_same_identity(now, settings):
    register("fin.tax", now=now, version="1")
    lease = services.agent_register(
        agent_id="fin.tax", node_id="node-a", version="2", now=later(now, 3000)
    )
    assert lease.created is False
    assert Agent.objects.count() == 1
    agent = Agent.objects.get()
    assert agent.version == "2"
    assert agent.lease_expires_at == later(now, 3000 + settings.REACH_LEASE_TTL_MS)


def test_it_refuses_a_move_while_the_old_lease_runs(now):
    register("fin.tax", "node-a", now=now)
    with pytest.raises(AgentHeldElsewhere) as err:
        services.agent_register(agent_id="fin.tax", node_id="node-b", now=later(now, 1000))
    assert "node-a" in err.value.detail
    assert Agent.objects.get().node.node_id == "node-a"


def test_it_moves_an_agent_once_the_old_lease_lapsed(now, settings):
    register("fin.tax", "node-a", now=now)
    moved_at = later(now, settings.REACH_LEASE_TTL_MS + 1)
    lease = services.agent_register(agent_id="fin.tax", node_id="node-b", now=moved_at)
    assert lease.agent.node.node_id == "node-b"
    event = RosterEvent.objects.get(kind="MOVED")
    assert event.detail == "from node-a"


@pytest.mark.parametrize("bad", ["", "tax", "Fin.tax", "fin.", ".tax", "fin.t ax", "fin.+", 7])
def test_it_rejects_malformed_agent_ids(bad):
    with pytest.raises(InvalidAgentId):
        services.agent_register(agent_id=bad, node_id="node-a")
    assert Agent.objects.count() == 0


def test_it_rejects_oversized_metadata_without_writing(settings):
    settings.REACH_MAX_METADATA_BYTES = 1000
    with pytest.raises(InvalidField) as err:
        services.agent_register(agent_id="fin.tax", node_id="n", metadata={"x": "y" * 2000})
    assert "limit is 1000 bytes" in err.value.detail
    assert Agent.objects.count() == 0 and ClusterNode.objects.count() == 0


def test_it_rejects_a_node_id_that_would_break_topics():
    with pytest.raises(InvalidField):
        services.agent_register(agent_id="fin.tax", node_id="node/+")


def test_it_renews_a_lease_and_records_load(now, settings):
    register("fin.tax", now=now)
    lease = services.agent_renew(
        agent_id="fin.tax", node_id="node-a", inflight=3, queue_depth=2, now=later(now, 4000)
    )
    agent = Agent.objects.get()
    assert agent.lease_expires_at == later(now, 4000 + settings.REACH_LEASE_TTL_MS)
    assert (agent.inflight, agent.queue_depth) == (3, 2)
    assert lease.expires_at == agent.lease_expires_at


def test_it_never_registers_on_renew():
    with pytest.raises(AgentNotFound):
        services.agent_renew(agent_id="fin.tax")
    assert Agent.objects.count() == 0


def test_it_reports_a_heartbeat_from_the_wrong_node_as_a_conflict(now):
    register("fin.tax", "node-a", now=now)
    with pytest.raises(WrongNode):
        services.agent_renew(agent_id="fin.tax", node_id="node-b")
    assert Agent.objects.get().node.node_id == "node-a"
    assert RosterEvent.objects.filter(kind="CONFLICT", node_id="node-b").count() == 1


def test_it_drains_then_deregisters(now):
    register("fin.tax", now=now)
    agent = services.agent_drain(agent_id="fin.tax", actor="ops", now=now)
    assert agent.status == Agent.Status.DRAINING
    services.agent_drain(agent_id="fin.tax", actor="ops")  # twice is a no-op
    assert RosterEvent.objects.filter(kind="DRAINED").count() == 1
    # A re-registration does not undo an operator's drain.
    services.agent_register(agent_id="fin.tax", node_id="node-a")
    assert Agent.objects.get().status == Agent.Status.DRAINING
    assert services.agent_deregister(agent_id="fin.tax", actor="ops") == "node-a"
    assert not Agent.objects.exists()
    assert RosterEvent.objects.filter(kind="DEREGISTERED", actor="ops").count() == 1


def test_it_audits_drain_and_deregister_itself():
    register("fin.tax", "node-a")
    services.agent_drain(agent_id="fin/tax", actor="ops")
    services.agent_drain(agent_id="fin.tax", actor="ops")  # accepted again, changes nothing
    services.agent_deregister(agent_id="fin.tax", actor="ops")
    rows = list(AuditEntry.objects.order_by("id").values_list(
        "actor", "action", "target", "result", "detail"))
    assert rows == [
        ("ops", "drain", "fin.tax", "ok", ""),
        ("ops", "drain", "fin.tax", "ok", ""),
        ("ops", "deregister", "fin.tax", "ok", "from node-a"),
    ]


@pytest.mark.parametrize("action", ["drain", "deregister"])
def test_it_commits_no_change_without_its_audit_row(monkeypatch, action):
    register("fin.tax", "node-a")

    def audit_fails(**kwargs):
        raise RuntimeError("the audit row cannot be written")

    monkeypatch.setattr(services, "audit_record", audit_fails)
    service = services.agent_drain if action == "drain" else services.agent_deregister
    with pytest.raises(RuntimeError):
        service(agent_id="fin.tax", actor="ops")
    assert Agent.objects.get().status == Agent.Status.ONLINE
    assert not RosterEvent.objects.exclude(kind="REGISTERED").exists()


def test_it_expires_leases_by_moving_time(now, settings):
    ttl = settings.REACH_LEASE_TTL_MS
    register("fin.tax", now=now)
    register("fin.vat", now=now)
    register("fin.old", now=now)
    services.agent_drain(agent_id="fin.old", now=now)
    services.agent_renew(agent_id="fin.vat", now=later(now, ttl - 1000))

    assert services.leases_expire(now=later(now, ttl - 1)) == services.ExpiryCounts(0, 0)
    counts = services.leases_expire(now=later(now, ttl + 1))

    assert counts == services.ExpiryCounts(offline=1, removed=1)
    assert Agent.objects.get(agent_id="fin.tax").status == Agent.Status.OFFLINE
    assert Agent.objects.get(agent_id="fin.vat").status == Agent.Status.ONLINE
    assert not Agent.objects.filter(agent_id="fin.old").exists()
    assert RosterEvent.objects.filter(kind="EXPIRED", agent_id="fin.tax").count() == 1
    assert RosterEvent.objects.filter(kind="REMOVED", agent_id="fin.old").count() == 1


def test_it_brings_an_expired_agent_back_on_heartbeat(now, settings):
    register("fin.tax", now=now)
    services.leases_expire(now=later(now, settings.REACH_LEASE_TTL_MS + 1))
    services.agent_renew(agent_id="fin.tax", node_id="node-a")
    agent = Agent.objects.get()
    assert agent.status == Agent.Status.ONLINE and agent.expired_at is None
    assert RosterEvent.objects.filter(kind="REVIVED").count() == 1


def deadline(agent_id: str):
    found = LeaseDeadline.objects.filter(agent__agent_id=agent_id).first()
    return found and found.expires_at


def test_a_live_agent_has_a_sweep_deadline_no_later_than_its_lease(now, settings):
    ttl = settings.REACH_LEASE_TTL_MS
    register("fin.tax", now=now)
    assert deadline("fin.tax") == later(now, ttl)
    # A heartbeat moves the lease, not the deadline: it stays early.
    services.agent_renew(agent_id="fin.tax", now=later(now, 1000))
    services.heartbeat_record(node_id="node-a", agents=[{"agentId": "fin.tax"}],
                              now=later(now, 2000))
    assert deadline("fin.tax") == later(now, ttl)
    # The sweep reaches it, finds the lease running, and moves it to the lease's end.
    assert services.leases_expire(now=later(now, ttl + 1)) == services.ExpiryCounts(0, 0)
    assert deadline("fin.tax") == later(now, 2000 + ttl)
    assert Agent.objects.get().status == Agent.Status.ONLINE
    # Lapsed: OFFLINE, and nothing left for the sweep.
    assert services.leases_expire(now=later(now, 2001 + ttl)).offline == 1
    assert deadline("fin.tax") is None
    # Back by a heartbeat: a deadline again, and a lapse is swept again.
    back = later(now, 5000 + ttl)
    services.heartbeat_record(node_id="node-a", agents=[{"agentId": "fin.tax"}], now=back)
    assert deadline("fin.tax") == later(back, ttl)
    assert services.leases_expire(now=later(back, ttl + 1)).offline == 1
    services.agent_renew(agent_id="fin.tax", now=later(back, 2 * ttl))
    assert deadline("fin.tax") == later(back, 3 * ttl)
    services.agent_deregister(agent_id="fin.tax")
    assert not LeaseDeadline.objects.exists()


def test_a_re_registration_sets_the_deadline_to_the_new_lease(now, settings):
    register("fin.tax", now=now)
    settings.REACH_LEASE_TTL_MS = 1000  # shorter than before: the lease ends earlier
    register("fin.tax", now=later(now, 10))
    assert deadline("fin.tax") == later(now, 1010)
    assert services.leases_expire(now=later(now, 1011)).offline == 1


def test_an_agent_written_around_the_services_is_swept_once_repaired(now, settings):
    register("fin.tax", now=now)
    LeaseDeadline.objects.all().delete()  # as a bulk import or a hand-made fix would leave it
    moment = later(now, settings.REACH_LEASE_TTL_MS + 1)
    assert services.leases_expire(now=moment) == services.ExpiryCounts(0, 0)
    assert services.lease_deadlines_repair() == 1
    assert services.lease_deadlines_repair() == 0
    assert services.leases_expire(now=moment).offline == 1


def test_an_offline_agent_drained_is_removed_by_the_sweep(now, settings):
    ttl = settings.REACH_LEASE_TTL_MS
    register("fin.tax", now=now)
    register("fin.vat", node_id="node-b", now=now)
    register("fin.fee", node_id="node-b", now=now)
    assert services.leases_expire(now=later(now, ttl + 1)).offline == 3
    # Drained while OFFLINE: live again (DRAINING), so the sweep must reach it.
    services.agent_drain(agent_id="fin.tax", now=later(now, ttl + 2))
    assert services.node_drain(node_id="node-b", actor="ops", now=later(now, ttl + 2)) == [
        "fin.fee", "fin.vat"]
    assert {deadline(a) for a in ("fin.tax", "fin.vat", "fin.fee")} == {later(now, ttl)}
    assert services.leases_expire(now=later(now, ttl + 3)) == services.ExpiryCounts(0, 3)
    assert not Agent.objects.exists() and not LeaseDeadline.objects.exists()


@pytest.mark.parametrize("renew", ["http", "mqtt"])
def test_a_renewal_that_ends_the_lease_earlier_moves_the_deadline(now, settings, renew):
    register("fin.tax", now=now)
    settings.REACH_LEASE_TTL_MS = 1000  # shorter than before: the lease ends earlier
    at = later(now, 10)
    if renew == "http":
        services.agent_renew(agent_id="fin.tax", now=at)
    else:
        services.heartbeat_record(node_id="node-a", agents=[{"agentId": "fin.tax"}], now=at)
    assert deadline("fin.tax") == later(now, 1010)
    assert services.leases_expire(now=later(now, 1011)).offline == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="row locks are PostgreSQL's")
def test_the_repair_leaves_an_agent_held_right_now_to_its_next_run(now):
    """The repair locks an agent before it writes the deadline, as the services do, and
    skips one that is held (a registration under way): it never waits on it, so the two
    cannot deadlock."""
    register("fin.tax", now=now)
    LeaseDeadline.objects.all().delete()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                Agent.objects.select_for_update().get(agent_id="fin.tax")
                held.set()
                release.wait(10)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        assert services.lease_deadlines_repair() == 0
    finally:
        release.set()
        holder.join(10)
    assert services.lease_deadlines_repair() == 1
    assert deadline("fin.tax") == Agent.objects.get().lease_expires_at


def test_a_deadline_left_on_an_agent_that_is_not_live_is_dropped(now, settings):
    register("fin.tax", now=now)
    Agent.objects.filter(agent_id="fin.tax").update(status=Agent.Status.OFFLINE)
    assert services.leases_expire(now=later(now, settings.REACH_LEASE_TTL_MS + 1)) == (
        services.ExpiryCounts(0, 0))
    assert not LeaseDeadline.objects.exists()
    assert not RosterEvent.objects.filter(kind="EXPIRED").exists()


@pytest.mark.django_db(transaction=True)
def test_it_changes_nothing_twice_when_two_sweeps_race(now, settings):
    for i in range(60):
        register(f"fin.a{i}", now=now)
    for i in range(20):
        register(f"fin.d{i}", now=now)
        services.agent_drain(agent_id=f"fin.d{i}", now=now)
    moment = later(now, settings.REACH_LEASE_TTL_MS + 1)
    results = run_at_once(lambda: services.leases_expire(now=moment))
    assert sum(r.offline for r in results) == 60
    assert sum(r.removed for r in results) == 20
    assert RosterEvent.objects.filter(kind="EXPIRED").count() == 60
    assert RosterEvent.objects.filter(kind="REMOVED").count() == 20
    assert Agent.objects.filter(status=Agent.Status.OFFLINE).count() == 60


def test_it_tracks_nodes_seen_and_silent(now, settings):
    services.node_seen(node_id="node-a", heartbeat_ms=5000, now=now)
    services.node_seen(node_id="node-a", now=later(now, 100))
    node = ClusterNode.objects.get()
    assert node.last_seen_at == later(now, 100) and node.heartbeat_ms == 5000
    # Down after three of its own heartbeat intervals of silence, not a moment before.
    assert services.nodes_sweep(now=later(now, 100 + 3 * 5000)) == 0
    assert services.nodes_sweep(now=later(now, 100 + 3 * 5000 + 1)) == 1
    assert ClusterNode.objects.get().status == ClusterNode.Status.DOWN
    services.node_seen(node_id="node-a", now=later(now, 20_000))
    assert ClusterNode.objects.get().status == ClusterNode.Status.ONLINE


def test_a_node_registered_and_never_heard_goes_down_too(now, settings):
    """Registered over HTTP, never a heartbeat: it stayed ONLINE with lastSeen null. It is
    REGISTERED (never heard) until a heartbeat, and DOWN after its silence."""
    register("fin.quiet", "node-quiet", now=now)
    node = ClusterNode.objects.get(node_id="node-quiet")
    assert node.last_seen_at is None and node.status == ClusterNode.Status.REGISTERED
    silent = 3 * settings.REACH_HEARTBEAT_MS
    assert services.nodes_sweep(now=later(node.created_at, silent)) == 0
    assert services.nodes_sweep(now=later(node.created_at, silent + 1)) == 1
    assert ClusterNode.objects.get(node_id="node-quiet").status == ClusterNode.Status.DOWN
