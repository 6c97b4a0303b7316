"""A streamed export holds no snapshot between its pages.

An export may take minutes; a transaction (or a server-side cursor) open across its pages
would hold one snapshot that long, and vacuum could reclaim no row version written since:
ingest and the sweeps would slow down behind it (RELIABILITY.md, a held snapshot). Each page
is one keyset query in autocommit (messages/selectors.py messages_pages, tasks_pages), so
between pages the export's connection is idle, with no transaction and no snapshot. This is
read from PostgreSQL itself, pg_stat_activity, on a second connection.
"""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection, transaction

from messages import task_views, views
from messages.outbound import SendRequest, message_send
from tests.conftest import logged_in, reader, register

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("console_hears")]


@pytest.fixture
def observer():
    if connection.vendor != "postgresql":
        pytest.skip("snapshots are PostgreSQL's: this runs in CI's second run")
    params = {**connection.get_connection_params(), "autocommit": True}
    with psycopg.connect(**params) as conn:
        yield conn


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def holds(observer, pid: int) -> tuple[str, bool, bool]:
    """(state, a snapshot is held, a transaction is open) of backend `pid`."""
    return observer.execute(
        "SELECT state, backend_xmin IS NOT NULL, xact_start IS NOT NULL "
        "FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()


def test_the_check_sees_a_snapshot_held_in_a_transaction(observer):
    """The yardstick: the same reading inside a REPEATABLE READ transaction that has read the
    table, as a report that wants one consistent view would hold it."""
    pid = backend_pid()
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cursor.execute("SELECT count(*) FROM a2a_message")
        assert holds(observer, pid) == ("idle in transaction", True, True)
    assert holds(observer, pid) == ("idle", False, False)


@pytest.mark.parametrize("path", ["/messages/export.jsonl", "/messages/export.csv",
                                  "/tasks/export.jsonl", "/tasks/export.csv"])
def test_no_snapshot_is_held_between_an_exports_pages(observer, monkeypatch, path):
    monkeypatch.setattr(views, "EXPORT_CHUNK", 2)
    monkeypatch.setattr(task_views, "EXPORT_CHUNK", 2)
    register("fin.tax", "node-b")
    for i in range(5):
        message_send(request=SendRequest(to="fin.tax", task_id=f"t-{i}"))
    viewer = logged_in(reader("victor"))
    response = viewer.get(path)
    assert response.status_code == 200
    chunks = iter(response.streaming_content)
    got = [next(chunks)]
    pid = backend_pid()  # the connection the export reads on (this thread's)
    between = [holds(observer, pid)]
    for chunk in chunks:
        got.append(chunk)
        between.append(holds(observer, pid))
    lines = b"".join(got).decode().splitlines()
    assert len(lines) == 5 + path.endswith(".csv")  # every task or row, and a CSV's header
    assert len(got) >= 3  # three pages of two at least: there were gaps to look at
    assert set(between) == {("idle", False, False)}, between
