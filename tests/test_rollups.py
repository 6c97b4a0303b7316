"""The numbers kept as rows are written (messages/ledger.py, messages/rollups.py): exact
under concurrent writers, unchanged by folds running at once, dropped past their keep, and
percentiles placed inside their histogram bucket."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection

from messages.ledger import AGENT, ALL, NODE
from messages.models import Rollup, Status
from messages.outbound import SendRequest, message_send
from messages.rollups import (
    KEEP_S,
    percentile,
    quantiles,
    rollup_buckets,
    rollup_totals,
    rollups_fold,
    subject_stats,
)
from tests.conftest import register, run_at_once

pytestmark = pytest.mark.usefixtures("console_hears")


def totals(step: int = 60) -> dict[str, Counter]:
    return rollup_totals(scope=AGENT, step=step, first=0, last=2**40)


@pytest.mark.django_db(transaction=True)
def test_concurrent_senders_are_counted_exactly_and_folds_change_no_sum():
    register("fin.tax", "node-b")
    register("fin.vat", "node-c")

    def send() -> None:
        for i in range(10):
            message_send(request=SendRequest(to="fin.tax" if i % 2 else "fin.vat"))

    run_at_once(send, threads=4)

    before = totals()
    assert before["fin.tax"]["tasks"] == 20 and before["fin.vat"]["requests"] == 20
    node = subject_stats(scope=NODE, subject="node-b", window="15m")
    assert node.counts["tasks"] == 20
    assert Rollup.objects.filter(folded=False).count() > Rollup.objects.filter(
        folded=True).count()

    # Two folds at once: each takes rows the other did not, and the sums stay.
    run_at_once(lambda: rollups_fold().read, threads=2)
    rollups_fold()
    assert totals() == before
    assert not Rollup.objects.filter(folded=False).exists()
    keys = list(Rollup.objects.values_list("step", "bucket", "scope", "subject", "metric"))
    # One row per key, or two where the folds ran side by side (PostgreSQL: one skipped the
    # folded row the other held); never the many rows the writers left.
    assert len(set(keys)) <= len(keys) <= 2 * len(set(keys))
    if connection.vendor == "sqlite":  # one writer at a time: the folds ran one after another
        assert len(keys) == len(set(keys))


@pytest.mark.django_db
def test_a_fold_drops_the_buckets_past_their_keep(now):
    old = now - timedelta(seconds=KEEP_S[60] + 120)
    Rollup.objects.bulk_create([
        Rollup(step=60, bucket=int(old.timestamp()) // 60, scope=ALL, subject="",
               metric="messages", n=5),
        Rollup(step=3600, bucket=int(old.timestamp()) // 3600, scope=ALL, subject="",
               metric="messages", n=5),
        Rollup(step=60, bucket=int(now.timestamp()) // 60, scope=ALL, subject="",
               metric="messages", n=7),
    ])
    result = rollups_fold(now=now)
    assert result.dropped == 1  # the minute bucket; the hour's is kept 8 days
    assert sorted(Rollup.objects.values_list("step", "n")) == [(60, 7), (3600, 5)]


def test_percentiles_are_placed_inside_their_bucket():
    bounds = (0.01, 0.1, 1.0)
    counts = Counter({"x:0": 2, "x:1": 2})  # 2 under 10 ms, 2 in 10–100 ms
    assert quantiles(counts, bounds, "x:") == (4, {
        0.5: pytest.approx(0.01), 0.95: pytest.approx(0.01 + 0.09 * 0.9),
        0.99: pytest.approx(0.01 + 0.09 * 0.98)})
    assert percentile(Counter({"x:3": 1}), bounds, "x:", 0.5) == 1.0  # over the last bound
    assert percentile(Counter(), bounds, "x:", 0.5) is None
    # A count taken away below zero (a move written before its insert was folded) is none.
    assert quantiles(Counter({"x:0": -1, "x:2": 1}), bounds, "x:")[0] == 1


@pytest.mark.django_db
def test_a_status_change_moves_the_count_in_every_scope(now):
    register("fin.tax", "node-b")
    row = message_send(request=SendRequest(to="fin.tax", timeout_ms=100), now=now)
    from messages.sweeps import deliveries_sweep

    deliveries_sweep(now=now + timedelta(seconds=1))  # never published: FAILED
    row.refresh_from_db()
    assert row.status == Status.FAILED
    for scope, subject in ((ALL, ""), (AGENT, "fin.tax"), (NODE, "node-b")):
        counts = rollup_totals(scope=scope, step=60, first=0, last=2**40)[subject]
        assert counts[f"s:{Status.FAILED}"] == 1, scope


@pytest.mark.django_db
def test_writers_write_the_finest_width_and_wider_reads_do_not_wait_for_the_fold(now):
    register("fin.tax", "node-b")
    for _ in range(3):
        message_send(request=SendRequest(to="fin.tax"), now=now)
    # One count, one row, at its scope's finest width: the fold makes the wider ones.
    assert set(Rollup.objects.values_list("scope", "step")) == {(ALL, 15), (AGENT, 60),
                                                                (NODE, 60)}

    def read() -> dict:
        hour = int(now.timestamp()) // 3600
        return {
            "agent hour": rollup_totals(scope=AGENT, step=3600, first=hour, last=hour),
            "all minute": rollup_totals(scope=ALL, step=60, first=0, last=2**40),
            "all hour": rollup_buckets(scope=ALL, subject="", step=3600, first=hour,
                                       last=hour),
            "24h": subject_stats(scope=NODE, subject="node-b", window="24h",
                                 now=now).counts,
        }

    before = read()
    assert before["agent hour"]["fin.tax"]["tasks"] == 3
    assert before["all minute"][""]["requests"] == 3
    assert before["all hour"][int(now.timestamp()) // 3600]["requests"] == 3
    assert before["24h"]["requests"] == 3
    rollups_fold(now=now)
    assert not Rollup.objects.filter(folded=False).exists()
    assert set(Rollup.objects.values_list("scope", "step")) == {
        (ALL, 15), (ALL, 60), (ALL, 3600), (AGENT, 60), (AGENT, 3600), (NODE, 60),
        (NODE, 3600)}
    assert read() == before


@pytest.mark.django_db(transaction=True)
def test_rows_an_earlier_version_wrote_at_every_width_are_counted_once(now):
    """Before the finest-only writes a count was written once per width. The migration marks
    such rows folded, so a wider read does not add the minute's row to the hour's."""
    from django.core.management import call_command

    call_command("migrate", "a2a", "0007", verbosity=0)
    try:
        minute, hour = int(now.timestamp()) // 60, int(now.timestamp()) // 3600
        Rollup.objects.bulk_create([
            Rollup(step=60, bucket=minute, scope=AGENT, subject="fin.tax", metric="tasks",
                   n=2),
            Rollup(step=3600, bucket=hour, scope=AGENT, subject="fin.tax", metric="tasks",
                   n=2),
        ])
    finally:
        call_command("migrate", "a2a", verbosity=0)
    assert rollup_totals(scope=AGENT, step=3600, first=hour, last=hour)["fin.tax"][
        "tasks"] == 2
    assert rollup_totals(scope=AGENT, step=60, first=minute, last=minute)["fin.tax"][
        "tasks"] == 2
    rollups_fold(now=now)
    assert rollup_totals(scope=AGENT, step=3600, first=hour, last=hour)["fin.tax"][
        "tasks"] == 2


@pytest.mark.django_db
def test_a_sends_numbers_and_its_task_are_written_in_one_statement_on_postgresql(now):
    """messages/ledger.py `Ledger.write`: on PostgreSQL the rollup insert leads the task
    upsert (a data-modifying WITH), one round trip; both land either way."""
    from django.test.utils import CaptureQueriesContext

    from messages.models import Task

    register("fin.tax", "node-b")
    with CaptureQueriesContext(connection) as queries:
        message_send(request=SendRequest(to="fin.tax", task_id="one-trip"), now=now)
    assert Task.objects.filter(task_id="one-trip", to_agent_id="fin.tax").count() == 1
    counts = rollup_totals(scope=AGENT, step=60, first=0, last=2**40)["fin.tax"]
    assert counts["tasks"] == 1 and counts["requests"] == 1
    rollup_inserts = [q["sql"] for q in queries.captured_queries
                      if "INSERT INTO a2a_rollup" in q["sql"]
                      or 'INSERT INTO "a2a_rollup"' in q["sql"]]
    assert len(rollup_inserts) == 1
    if connection.vendor == "postgresql":
        statement = rollup_inserts[0]
        assert statement.lstrip().startswith("WITH") and "a2a_task" in statement
