"""The retention prune keeps up: each call runs until nothing is due or its budget is spent,
deletes by primary key (messages, their transitions, the tasks they leave empty), and says
when it is behind, in the log and in /metrics."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest

from messages.models import Message, Status, Task, Transition
from messages.outbound import SendRequest, message_send
from messages.selectors import retention_behind_s
from messages.sweeps import messages_prune
from tests.conftest import register
from tests.test_metrics import metrics, value

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("console_hears")]


@pytest.fixture
def one_table(monkeypatch):
    """The prune as it runs on a history that is one table (SQLite, or PostgreSQL with
    REACH_PARTITIONS=off): the batched delete, which works alike on a partitioned table,
    where the partition drop does this work instead (tests/test_partitions.py)."""
    for module in ("messages.sweeps", "messages.selectors"):
        monkeypatch.setattr(f"{module}.history_partitioned", lambda: False)


def sent(at, task_id: str | None = None) -> Message:
    return message_send(request=SendRequest(to="fin.nobody", task_id=task_id), now=at)


def test_a_call_takes_everything_due_with_its_transitions_and_tasks(now, settings, monkeypatch):
    settings.REACH_RETENTION_DAYS = 7
    monkeypatch.setattr("messages.sweeps.PRUNE_BATCH", 2)  # several batches in one call
    old = [sent(now - timedelta(days=8, minutes=i)) for i in range(5)]
    kept = sent(now - timedelta(days=6))
    assert Transition.objects.filter(message__in=old).count() == 10  # SENT, UNDELIVERABLE
    assert Task.objects.count() == 6

    assert messages_prune(now=now) == 5

    assert list(Message.objects.values_list("pk", flat=True)) == [kept.pk]
    assert set(Transition.objects.values_list("message_id", flat=True)) == {kept.pk}
    assert list(Task.objects.values_list("task_id", flat=True)) == [kept.task_id]
    assert retention_behind_s(now=now) == 0


def test_a_task_that_changed_within_the_retention_keeps_its_entry(now, settings):
    settings.REACH_RETENTION_DAYS = 7
    first = sent(now - timedelta(days=8), task_id="t-long")
    again = sent(now - timedelta(days=2), task_id="t-long")
    assert messages_prune(now=now) == 1
    assert list(Message.objects.values_list("pk", flat=True)) == [again.pk]
    assert Task.objects.filter(task_id="t-long").exists()
    assert not Message.objects.filter(pk=first.pk).exists()


def test_a_retention_of_a_few_minutes_is_taken(now, settings, one_table):
    settings.REACH_RETENTION_DAYS = 0.0035  # about 5 minutes
    stale = sent(now - timedelta(minutes=6))
    fresh = sent(now - timedelta(minutes=4))
    assert messages_prune(now=now) == 1
    assert list(Message.objects.values_list("pk", flat=True)) == [fresh.pk]
    assert not Message.objects.filter(pk=stale.pk).exists()


def test_what_is_still_under_way_outlives_a_short_retention(now, settings, one_table):
    """A retention shorter than a task's life never deletes the outbox's rows or an open
    request: the deadline ends them, and a later call takes them."""
    settings.REACH_RETENTION_DAYS = 0.0035
    register("fin.tax", "node-b")
    open_request = message_send(request=SendRequest(to="fin.tax", timeout_ms=3_600_000),
                                now=now - timedelta(minutes=10))
    assert open_request.status == Status.SENT
    ended = sent(now - timedelta(minutes=10))
    assert messages_prune(now=now) == 1
    assert list(Message.objects.values_list("pk", flat=True)) == [open_request.pk]
    Message.objects.filter(pk=open_request.pk).update(status=Status.EXPIRED)
    assert messages_prune(now=now) == 1
    assert not Message.objects.filter(pk__in=[open_request.pk, ended.pk]).exists()


def test_a_call_stops_at_its_budget_and_says_the_retention_is_behind(now, settings,
                                                                        monkeypatch, caplog,
                                                                        client, one_table):
    settings.REACH_RETENTION_DAYS = 1
    monkeypatch.setattr("messages.sweeps.PRUNE_BATCH", 2)
    rows = [sent(now - timedelta(days=3, hours=i)) for i in range(5)]
    oldest = min(r.created_at for r in rows)
    expected_behind = (now - timedelta(days=1) - oldest).total_seconds()
    assert retention_behind_s(now=now) == pytest.approx(expected_behind)
    with caplog.at_level(logging.WARNING, logger="messages.sweeps"):
        # A budget spent at once: one batch, the oldest two, and the rest waits.
        assert messages_prune(now=now, budget_s=0) == 2
    assert "retention is behind: the oldest message is 50.0 h past" in caplog.text
    assert Message.objects.count() == 3
    behind = retention_behind_s()
    assert 2 * 86400 < behind < 3 * 86400
    assert value(metrics(client), "reach_retention_behind_seconds") == pytest.approx(behind,
                                                                                    rel=0.01)
    # The next calls catch up, and the gauge says so.
    assert messages_prune(now=now, budget_s=0) == 2
    assert messages_prune(now=now, budget_s=0) == 1
    assert retention_behind_s(now=now) == 0
    assert value(metrics(client), "reach_retention_behind_seconds") == 0


def test_keep_everything_is_never_behind(now, settings):
    settings.REACH_RETENTION_DAYS = 0
    sent(now - timedelta(days=400))
    assert messages_prune(now=now) == 0
    assert retention_behind_s(now=now) == 0
