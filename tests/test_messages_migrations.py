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


def _indexes() -> dict[str, tuple[str, ...]]:
    """a2a_message's indexes (not its primary key): name → columns."""
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, "a2a_message")
    return {name: tuple(c["columns"]) for name, c in found.items()
            if c["index"] and not c["primary_key"]}


def test_migration_0009_drops_the_indexes_no_query_reads_and_puts_them_back_reversed():
    def single_column(columns: tuple[str, ...]) -> list[str]:
        return [name for name, cols in _indexes().items() if cols == columns]

    now = _indexes()
    assert not [n for n in now if n.endswith("_like")], now
    assert single_column(("idempotency_key",)) == [] and single_column(("task_id",)) == []
    assert single_column(("conversation_id",)) == ["a2a_conversation"]
    assert single_column(("in_reply_to",)) == ["a2a_in_reply_to"]
    assert ("task_id", "created_at") in now.values()  # what a lookup by task reads now
    postgres = connection.vendor == "postgresql"
    try:
        migrate([("a2a", "0008_rollups_finest_only")])
        before = _indexes()
        for column in ("idempotency_key", "task_id", "conversation_id", "in_reply_to"):
            assert len(single_column((column,))) == (2 if postgres else 1), column
        if postgres:  # Django's LIKE twins of the text columns, message_id's included
            assert len([n for n in before if n.endswith("_like")]) == 5
    finally:
        migrate(latest())
    assert _indexes() == now


def test_migrations_0010_0011_keep_every_payload_stored_and_add_the_index_of_kept_ones():
    try:
        old = migrate([("a2a", "0009_fewer_indexes")])
        assert "a2a_payload_kept" not in _indexes()
        message = old.get_model("a2a", "Message")
        row = message.objects.create(
            message_id=str(uuid.uuid4()), task_id="t-old", message_type="TASK_REQUEST",
            direction="SEND", status="COMPLETED", payload={"q": 1})
    finally:
        migrate(latest())
    assert _indexes()["a2a_payload_kept"] == ("updated_at",)
    kept = Message.objects.get(pk=row.pk)
    assert (kept.payload, kept.payload_dropped_at) == ({"q": 1}, None)
    if connection.vendor == "postgresql":  # built CONCURRENTLY: valid once the step is done
        with connection.cursor() as cursor:
            cursor.execute("SELECT i.indisvalid FROM pg_index i JOIN pg_class c"
                           " ON c.oid = i.indexrelid WHERE c.relname = 'a2a_payload_kept'")
            assert cursor.fetchone() == (True,)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="a concurrent build is PostgreSQL's")
def test_migration_0011_rerun_after_a_failed_concurrent_build_builds_the_index_again():
    def valid() -> list[tuple[bool]]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT i.indisvalid FROM pg_index i JOIN pg_class c"
                           " ON c.oid = i.indexrelid WHERE c.relname = 'a2a_payload_kept'")
            return cursor.fetchall()

    try:
        migrate([("a2a", "0010_payload_retention")])
        assert valid() == []
        # What a build that failed half-way leaves: the index, marked INVALID.
        with connection.cursor() as cursor:
            cursor.execute("CREATE INDEX a2a_payload_kept ON a2a_message (updated_at)"
                           " WHERE payload IS NOT NULL AND message_type = 'TASK_REQUEST'")
            cursor.execute("UPDATE pg_index SET indisvalid = false WHERE indexrelid ="
                           " 'a2a_payload_kept'::regclass")
        assert valid() == [(False,)]
    finally:
        migrate(latest())
    assert valid() == [(True,)]
