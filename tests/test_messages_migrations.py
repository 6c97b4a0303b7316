"""Messages migration 0006 on a database that already holds messages: every task request
written before becomes part of its task (retries and resends one task, with its outcome),
and observed requests still waiting get the deadline that ends them."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from messages.models import Message, Status, Task
from messages.sweeps import deliveries_sweep

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("console_hears")]

BEFORE = [("a2a", "0005_timeline_indexes")]


def migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


def latest() -> list[tuple[str, str]]:
    """Every app at its newest migration (0006 and all after it): the tests that follow
    run on the whole schema."""
    return MigrationExecutor(connection).loader.graph.leaf_nodes()


def test_migration_0006_makes_tasks_of_the_rows_already_stored():
    old = migrate(BEFORE)
    now = timezone.now()
    try:
        message = old.get_model("a2a", "Message")

        def stored(task_id, status, *, at, attempt=1, direction="SEND", **fields):
            return message.objects.create(
                message_id=str(uuid.uuid4()), task_id=task_id, idempotency_key=task_id,
                message_type="TASK_REQUEST", direction=direction, status=status,
                to_agent_id="fin.tax", target_node_id="node-b", attempt=attempt,
                created_at=at, updated_at=at, **fields)

        stored("t-retried", "RETRIED", at=now - timedelta(minutes=3))
        stored("t-retried", "COMPLETED", at=now - timedelta(minutes=2), attempt=2,
               finished_at=now - timedelta(minutes=1))
        stored("t-failed", "UNDELIVERABLE", at=now - timedelta(minutes=2),
               error="no agent fin.tax is on the roster")
        stored("t-seen", "OBSERVED", at=now - timedelta(minutes=5), direction="OBSERVED")
    finally:
        migrate(latest())

    tasks = {t.task_id: t for t in Task.objects.all()}
    assert set(tasks) == {"t-retried", "t-failed", "t-seen"}
    retried = tasks["t-retried"]
    assert (retried.status, retried.attempts, retried.direction) == ("COMPLETED", 2, "SEND")
    assert retried.created_at == now - timedelta(minutes=3)
    assert retried.finished_at == now - timedelta(minutes=1)
    assert tasks["t-failed"].error == "no agent fin.tax is on the roster"
    # The observed request seen five minutes ago is past its 30 s: the sweep ends it.
    seen = Message.objects.get(task_id="t-seen")
    assert seen.deadline_at == seen.created_at + timedelta(seconds=30)
    deliveries_sweep(now=now)
    seen.refresh_from_db()
    assert seen.status == Status.EXPIRED
    assert Task.objects.get(task_id="t-seen").status == Status.EXPIRED
