"""Roster migration 0008 on a database that already holds a roster: every live agent gets
its sweep deadline, and the sweep reaches the lapsed ones afterwards."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from roster import services
from roster.models import Agent, LeaseDeadline

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("console_hears")]

BEFORE = [("roster", "0007_lean_lease_indexes")]


def migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


def latest() -> list[tuple[str, str]]:
    """Every app at its newest migration (0008 and all after it): the tests that follow
    run on the whole schema."""
    return MigrationExecutor(connection).loader.graph.leaf_nodes()


def test_migration_0008_gives_every_live_agent_its_deadline():
    old = migrate(BEFORE)
    try:
        now = timezone.now()
        ns = old.get_model("roster", "Namespace").objects.create(name="fin")
        node = old.get_model("roster", "ClusterNode").objects.create(node_id="node-a")
        old_agent = old.get_model("roster", "Agent")
        for name, status, minutes in [("live", "ONLINE", 5), ("lapsed", "ONLINE", -1),
                                      ("draining", "DRAINING", 5), ("gone", "OFFLINE", -9)]:
            old_agent.objects.create(
                namespace=ns, node=node, name=name, agent_id=f"fin.{name}", segment=name,
                status=status, lease_expires_at=now + timedelta(minutes=minutes))
    finally:
        migrate(latest())
    deadlines = dict(LeaseDeadline.objects.values_list("agent__agent_id", "expires_at"))
    leases = dict(Agent.objects.values_list("agent_id", "lease_expires_at"))
    assert deadlines == {agent_id: leases[agent_id]
                         for agent_id in ("fin.live", "fin.lapsed", "fin.draining")}
    assert services.leases_expire(now=now) == services.ExpiryCounts(offline=1, removed=0)
    assert Agent.objects.get(agent_id="fin.lapsed").status == Agent.Status.OFFLINE
