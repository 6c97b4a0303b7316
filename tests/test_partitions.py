"""The history partitioned by time on PostgreSQL (messages/partitions.py): partitions made
ahead and dropped whole, one row per message id across partition boundaries, reads whose
plans read only their partitions, and the migration of a table that already holds rows."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from messages import partitions
from messages.models import Message, MessageKey, Status, Task, Transition
from messages.outbound import SendRequest, message_send
from messages.partitions import (
    history_partitioned,
    partitions_drop,
    partitions_ensure,
    partitions_list,
    pk_floor,
    pk_time,
    span_start,
)
from messages.selectors import (
    MessageFilter,
    message_replies,
    messages_filter,
    messages_page,
    newest_message_id,
    task_attempts,
)
from messages.state import messages_insert_new
from messages.sweeps import messages_prune
from messages.taskbook import task_story
from tests.conftest import run_at_once
from tests.test_insert_path import received

pytestmark = [
    pytest.mark.skipif("not __import__('django.db').db.connection.vendor == 'postgresql'",
                       reason="partitions are PostgreSQL's; SQLite keeps one table and the "
                              "batched delete (tests/test_retention.py)"),
    pytest.mark.usefixtures("console_hears"),
]

DAY = timedelta(days=1)


def plan(queryset) -> dict:
    """The plan PostgreSQL makes for `queryset`, as JSON."""
    sql, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (FORMAT JSON) " + sql, params)
        found = cursor.fetchone()[0]
    return (json.loads(found) if isinstance(found, str) else found)[0]["Plan"]


def relations(node: dict) -> set[str]:
    """Every table or index partition a plan reads."""
    found = {node[k] for k in ("Relation Name",) if k in node}
    for child in node.get("Plans", []):
        found |= relations(child)
    return found


def message_partitions_read(queryset) -> set[str]:
    return {r for r in relations(plan(queryset)) if r.startswith("a2a_message_p")}


@pytest.mark.django_db
def test_the_history_is_partitioned_with_spans_made_ahead():
    assert history_partitioned()
    messages = partitions_list("a2a_message")
    transitions = partitions_list("a2a_transition")
    assert [(p.lo, p.hi) for p in messages] == [(p.lo, p.hi) for p in transitions]
    assert messages[0].lo is None  # the table the migration found
    # Contiguous, and the current span plus REACH_PARTITIONS_AHEAD after it.
    assert all(a.hi == b.lo for a, b in zip(messages, messages[1:], strict=False))
    assert len(messages) - 1 >= 4


@pytest.mark.django_db(transaction=True)
def test_two_maintainers_at_once_make_each_partition_once(now):
    later = now + timedelta(days=10)
    made = run_at_once(lambda: partitions_ensure(now=later), threads=4)
    names = [name for batch in made for name in batch]
    assert len(names) == len(set(names)) and names  # each made by one caller only
    assert partitions_ensure(now=later) == []  # and again: nothing to do
    bounds = partitions_list()
    assert all(a.hi == b.lo for a, b in zip(bounds, bounds[1:], strict=False))
    assert bounds[-1].hi >= pk_floor(span_start(later) + 4 * DAY)


@pytest.mark.django_db(transaction=True)
def test_sixteen_writers_of_one_id_across_midnight_store_one_row(now):
    """Half of the copies are made just before midnight and half just after: their rows
    would fall into two partitions, yet one is stored and one writer got it back."""
    midnight = span_start(now) + 2 * DAY
    message_id = f"m-{uuid.uuid4()}"
    copies = iter([midnight - timedelta(milliseconds=5)] * 8
                  + [midnight + timedelta(milliseconds=5)] * 8)
    times = [next(copies) for _ in range(16)]
    taken = iter(times)

    def write():
        return messages_insert_new([received(message_id, next(taken))])

    results = run_at_once(write, threads=16)
    assert sum(len(r) for r in results) == 1
    assert Message.objects.filter(message_id=message_id).count() == 1
    assert MessageKey.objects.filter(message_id=message_id).count() == 1
    # And a copy hours later, in another partition again, is still the same message.
    assert messages_insert_new([received(message_id, midnight + timedelta(hours=20))]) == []
    row = Message.objects.get(message_id=message_id)
    assert MessageKey.objects.get(message_id=message_id).message_pk == row.pk


@pytest.mark.django_db
def test_a_row_lands_in_the_partition_of_its_time(now):
    start = span_start(now)
    row = messages_insert_new([received(f"m-{uuid.uuid4()}", start + DAY + timedelta(hours=3))])[0]
    with connection.cursor() as cursor:
        cursor.execute("SELECT tableoid::regclass::text FROM a2a_message WHERE id = %s", [row.pk])
        assert cursor.fetchone()[0] == f"a2a_message_p{start + DAY:%Y%m%d_%H%M%S}"


@pytest.mark.django_db
def test_a_write_past_every_partition_makes_its_own(now, caplog):
    """The beat stopped for longer than the spans made ahead: the write is not lost."""
    far = now + timedelta(days=30)
    stored = messages_insert_new([received(f"m-{uuid.uuid4()}", far)])
    assert len(stored) == 1
    assert partitions_list()[-1].hi > pk_floor(far)
    assert "making them on the write path" in caplog.text


def _sent(at, **extra):
    return message_send(request=SendRequest(to="fin.nobody", **extra), now=at)


@pytest.mark.django_db
def test_partitions_past_the_retention_are_dropped_whole_with_their_transitions(now, settings):
    settings.REACH_RETENTION_DAYS = 1
    start = span_start(now)
    old = _sent(start - 2 * DAY)                       # the migration's table
    today = _sent(start + timedelta(hours=1))          # today's partition
    tomorrow = _sent(start + DAY + timedelta(hours=1))
    Message.objects.filter(pk=tomorrow.pk).update(resend_of=today)
    assert Transition.objects.filter(message_id=today.pk).exists()

    dropped = partitions_drop(now=start + DAY + timedelta(minutes=30))
    assert [p.name for p in dropped] == ["a2a_message_p0"]
    assert not Message.objects.filter(pk=old.pk).exists()
    assert not Transition.objects.filter(message_id=old.pk).exists()
    assert Message.objects.filter(pk=today.pk).exists()

    dropped = partitions_drop(now=start + 2 * DAY + timedelta(minutes=30))
    assert [p.name for p in dropped] == [f"a2a_message_p{start:%Y%m%d_%H%M%S}"]
    assert list(Message.objects.values_list("pk", flat=True)) == [tomorrow.pk]
    assert not Transition.objects.filter(message_id=today.pk).exists()
    # The resend that pointed into the dropped partition is unlinked, not left dangling.
    assert Message.objects.get(pk=tomorrow.pk).resend_of_id is None
    # And the keys of what went are pruned, so the key table stays as long as the history.
    assert partitions.message_keys_prune(stop_at=float("inf")) >= 1
    assert not MessageKey.objects.filter(message_id=today.message_id).exists()
    assert MessageKey.objects.filter(message_id=tomorrow.message_id).exists()


@pytest.mark.django_db
def test_a_partition_holding_work_under_way_waits(now, settings, caplog):
    from tests.conftest import register

    settings.REACH_RETENTION_DAYS = 1
    register("fin.tax", "node-b", now=now)
    start = span_start(now)
    pending = message_send(request=SendRequest(to="fin.tax", timeout_ms=3_600_000),
                           now=start + timedelta(hours=1))
    assert pending.status == Status.SENT
    assert partitions_drop(now=start + DAY + timedelta(minutes=30))[0].name == "a2a_message_p0"
    assert partitions_drop(now=start + 2 * DAY + timedelta(minutes=30)) == []
    assert "holds a message still under way" in caplog.text
    Message.objects.filter(pk=pending.pk).update(status=Status.EXPIRED)
    assert len(partitions_drop(now=start + 2 * DAY + timedelta(minutes=30))) == 1
    assert not Message.objects.filter(pk=pending.pk).exists()


@pytest.mark.django_db
def test_the_prune_deletes_only_from_the_migrations_table(now, settings):
    settings.REACH_RETENTION_DAYS = 1
    start = span_start(now)
    old = _sent(start - 3 * DAY)
    recent = _sent(now - timedelta(minutes=1))
    assert messages_prune(now=now + 2 * DAY) == 1  # `recent` waits for its partition
    assert not Message.objects.filter(pk=old.pk).exists()
    assert Message.objects.filter(pk=recent.pk).exists()
    due = Message.objects.filter(created_at__lt=now, pk__lt=partitions_list()[0].hi)
    assert message_partitions_read(due) == {"a2a_message_p0"}


@pytest.mark.django_db
def test_reads_by_key_and_by_time_read_only_their_partitions(now):
    start = span_start(now)
    row = _sent(start + DAY + timedelta(hours=2), task_id="t-two-days")
    later = _sent(start + 2 * DAY + timedelta(hours=2), task_id="t-two-days")
    tomorrow = f"a2a_message_p{start + DAY:%Y%m%d_%H%M%S}"

    # By primary key: the claims, the guarded updates, Django's own save().
    assert message_partitions_read(Message.objects.filter(pk=row.pk)) == {tomorrow}
    # A message's transitions live in the partition cut at its bounds.
    read = {r for r in relations(plan(Transition.objects.filter(message_id=row.pk)))
            if r.startswith("a2a_transition_p")}
    assert read == {"a2a_transition" + tomorrow[len("a2a_message"):]}
    # The timeline within a time window.
    flt = MessageFilter(since_at=start + DAY + timedelta(hours=1),
                        until_at=start + DAY + timedelta(hours=12))
    # (and the migration's table, while it is there: its ids carry no time)
    assert message_partitions_read(messages_filter(flt)) == {tomorrow, "a2a_message_p0"}
    assert row.pk in [m.pk for m in messages_page(flt).rows]
    # A trace's attempts and a message's answers: from the task's first day on, nothing
    # older is read (today's partition; the migration's table is, while it is there).
    today = f"a2a_message_p{start:%Y%m%d_%H%M%S}"
    for query in (task_attempts(later), message_replies(row)):
        read = message_partitions_read(query)
        assert tomorrow in read and today not in read
    assert [m.pk for m in task_attempts(later)] == [row.pk, later.pk]
    # A task's story, its attempts two days apart, from its first day on.
    task = Task.objects.get(task_id="t-two-days", direction="SEND")
    story = task_story(task)
    assert {m.pk for m in story.messages} >= {row.pk, later.pk}
    with CaptureQueriesContext(connection) as queries:
        task_story(task)
    read = " ".join(q["sql"] for q in queries.captured_queries if "a2a_message" in q["sql"])
    assert '"a2a_message"."id" >=' in read
    # The timeline filtered by that task: from its first entry on, and all of it.
    flt = MessageFilter(task="t-two-days")
    read = message_partitions_read(messages_filter(flt))
    assert tomorrow in read and today not in read
    assert [m.pk for m in messages_page(flt).rows] == [later.pk, row.pk]
    # A task id with no entry (an answer to a request never seen) is not bounded.
    assert today in message_partitions_read(messages_filter(MessageFilter(task="t-none")))


@pytest.mark.django_db
def test_the_newest_id_is_read_from_the_key_table_and_is_the_newest_row(now):
    rows = [_sent(now - timedelta(hours=h)) for h in (0, 5, 30)]
    with CaptureQueriesContext(connection) as queries:
        newest = newest_message_id()
    assert newest == max(r.pk for r in rows) == Message.objects.order_by("-pk")[0].pk
    assert "a2a_message_key" in queries.captured_queries[-1]["sql"]


@pytest.mark.django_db(transaction=True)
def test_the_migration_moves_a_table_that_holds_rows_and_keeps_one_row_per_id(now):
    from tests.test_messages_migrations import latest, migrate

    migrate([("a2a", "0012_partition_ready")])
    assert not history_partitioned()
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE relname = 'a2a_message'")
        assert cursor.fetchone()[0] == "r"
    before = [_sent(now - timedelta(days=d)) for d in range(3)]
    try:
        migrate(latest())
        assert history_partitioned()
        assert set(Message.objects.values_list("pk", flat=True)) >= {m.pk for m in before}
        assert Transition.objects.filter(message_id__in=[m.pk for m in before]).count() == 6
        assert set(MessageKey.objects.values_list("message_id", flat=True)) >= {
            m.message_id for m in before}
        # An id stored before the move is still the one row it was.
        again = received(before[0].message_id, now)
        assert messages_insert_new([again]) == []
        # The old table holds rows of today too (sequence ids, below the partitions): a
        # read from a moment of today still finds them, and the table is not dropped while
        # its newest row is within the retention, whatever its bound says.
        from messages.partitions import history_since

        assert before[0].pk in set(history_since(Message.objects.all(), before[0].created_at)
                                   .values_list("pk", flat=True))
        with override_settings(REACH_RETENTION_DAYS=1):
            assert partitions_drop(now=before[0].created_at + DAY - timedelta(minutes=1)) == []
        # New rows take ids of their time, above every old one, in the current partition.
        fresh = _sent(now)
        assert fresh.pk > max(m.pk for m in before)
        assert fresh.pk >= partitions_list()[1].lo
    finally:
        migrate(latest())


@pytest.mark.django_db(transaction=True)
def test_the_command_moves_the_history_both_ways_and_refuses_a_second_time(now):
    from django.core.management import CommandError, call_command

    # Rows of before today: the first partition made again ends where it did, at today's
    # start, as the other tests of this session expect.
    rows = [_sent(span_start(now) - timedelta(hours=h + 1)) for h in range(3)]
    try:
        with pytest.raises(CommandError, match="already partitioned"):
            call_command("history_partition")
        call_command("history_partition", undo=True)
        assert not history_partitioned()
        assert set(Message.objects.values_list("pk", flat=True)) == {r.pk for r in rows}
        # One table again: its unique index refuses a second row of an id.
        assert messages_insert_new([received(rows[0].message_id, now)]) == []
        call_command("history_partition")
        assert history_partitioned()
        assert set(Message.objects.values_list("pk", flat=True)) == {r.pk for r in rows}
        assert messages_insert_new([received(rows[1].message_id, now)]) == []
        assert len(messages_insert_new([received(f"m-{uuid.uuid4()}", now)])) == 1
    finally:
        if not history_partitioned():
            call_command("history_partition")


@pytest.mark.django_db(transaction=True)
def test_a_long_reader_delays_no_partition_made_and_a_drop_gives_way_to_it(now, settings,
                                                                           caplog):
    """A transaction that reads the history for minutes (a report, a backup's snapshot):
    making partitions does not wait for it, and a drop, which must, gives up within its
    lock timeout instead of queueing every query behind it."""
    import psycopg

    settings.REACH_RETENTION_DAYS = 1
    start = span_start(now)
    _sent(start - 2 * DAY)  # in the table the migration found, due to go
    due = pk_time(partitions_list()[0].hi) + DAY + timedelta(minutes=30)
    params = connection.get_connection_params()
    with psycopg.connect(**{k: v for k, v in params.items() if k != "cursor_factory"}) as other:
        other.execute("SELECT count(*) FROM a2a_message").fetchone()  # holds its lock
        made = partitions_ensure(now=now + timedelta(days=20))
        assert made  # made while the reader reads
        assert partitions_drop(now=due) == []
        assert "not dropped" in caplog.text and "lock timeout" in caplog.text
        other.rollback()
    # (That the same drop goes through once nobody holds the table is the test above; here
    # the partition stays, as the rest of the session's tests write rows of past days.)
    assert partitions_list()[0].name == "a2a_message_p0"
