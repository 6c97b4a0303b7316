"""A web request's query that the database does not answer is cut off at its bound and the
request answered 503 with Retry-After (reachconsole/core/query_bound.py), never left hanging.

The database here is really stuck for the request: another connection holds an exclusive
lock on the table the request reads, so PostgreSQL does not answer until it is released. (A
stalled network path, where not even an error could arrive, is the fault runs' case:
tests/test_fault_runs.py postgres-stall, through tests/stallproxy.py.)
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest
from django.db import OperationalError, connection

from reachconsole.core.query_bound import QueryBound
from reachconsole.unavailable import DATABASE, RETRY_AFTER_S, unavailable_reason
from tests.conftest import register

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def locker():
    """A second connection that can lock a table until the test lets go."""
    if connection.vendor != "postgresql":
        pytest.skip("the bound is for PostgreSQL's network path: this runs in CI's second run")
    with psycopg.connect(**connection.get_connection_params()) as conn:
        yield conn
        conn.rollback()


@pytest.fixture
def bounded():
    bound = QueryBound(2.0)
    try:
        with connection.execute_wrapper(bound):
            yield bound
    finally:
        # The cut-off connection is broken: give it back (the pool discards it).
        connection.close()


def test_the_watchdog_sleeps_while_nothing_runs_and_wakes_for_the_next_block():
    """It sleeps until the earliest deadline, or with none while nothing runs; the first
    block after an idle spell wakes it, and one that outlasts its bound is cut off. A
    socket pair stands for the connection: the watchdog knows only its descriptor."""
    bound = QueryBound(0.3)
    ours, theirs = socket.socketpair()
    ours.settimeout(10)  # a watchdog that never woke fails here instead of hanging
    try:
        with bound.watching(ours):
            pass  # a query that returned at once
        deadline = time.monotonic() + 10
        # Past that query's deadline, with nothing running: asleep with no deadline.
        while not (bound._sleeping_until is None and bound._thread is not None
                   and not bound._running and bound._wake_count >= 1):
            assert time.monotonic() < deadline, "the watchdog did not go back to sleep"
            time.sleep(0.05)
        woken = bound._wake_count
        time.sleep(0.5)  # an idle spell longer than the bound: nothing wakes it
        assert bound._wake_count == woken
        with bound.watching(ours):
            assert ours.recv(1) == b""  # returns only because the watchdog shut it down
        assert bound.cut == 1
    finally:
        ours.close()
        theirs.close()


def test_a_query_past_its_bound_is_cut_off_with_a_connection_error(locker, bounded):
    register("fin.tax", "node-b")
    # Held until the test ends: the query returns only because it is cut off.
    locker.execute("LOCK TABLE roster_agent IN ACCESS EXCLUSIVE MODE")
    with pytest.raises(OperationalError) as raised, connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM roster_agent")
    assert unavailable_reason(raised.value) == DATABASE  # what answers 503, not 500
    assert bounded.cut == 1


def test_a_request_stuck_on_the_database_answers_503_and_others_are_untouched(
        locker, bounded, api):
    register("fin.tax", "node-b")
    assert api.get("/api/roster/agents").status_code == 200  # within the bound: untouched
    assert bounded.cut == 0
    locker.execute("LOCK TABLE roster_agent IN ACCESS EXCLUSIVE MODE")
    # Let go long after the bound: the request must not have waited for it.
    released = threading.Event()

    def release() -> None:
        released.set()
        locker.rollback()

    timer = threading.Timer(15, release)
    timer.start()
    try:
        response = api.get("/api/roster/agents")
        waited_for_the_lock = released.is_set()
    finally:
        timer.cancel()
    assert response.status_code == 503, response.content[:500]
    assert response["Retry-After"] == str(RETRY_AFTER_S)
    assert "cannot reach its database" in response.json()["detail"]
    assert not waited_for_the_lock
    assert bounded.cut == 1


def test_the_pools_check_of_a_stalled_connection_is_cut_off_too(locker, proxy):
    """Before handing a connection out the pool checks it, on the socket, outside any query:
    through a path that has stalled (tests/stallproxy.py holds it open and still) that check
    would wait for as long as the stall lasts. Bounded, it is cut off, the pool drops that
    connection, and the caller gets the pool's own timeout (a 503), while the path is
    still stalled."""
    from psycopg_pool import ConnectionPool, PoolTimeout

    pool = ConnectionPool(kwargs={**connection.get_connection_params(), "host": proxy.host,
                                  "port": proxy.port, "autocommit": True},
                          min_size=1, max_size=1, timeout=2, open=False,
                          check=ConnectionPool.check_connection)
    bound = QueryBound(1.0)
    bound.pool_check_bound(pool)
    bound.pool_check_bound(pool)  # once is enough: not wrapped twice
    try:
        pool.open(wait=True)
        with pool.connection() as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        # The path moves again long after the pool's timeout: a check that waited for it
        # would hand the connection out then, with no PoolTimeout.
        with stalled_for_a_while(proxy) as still_stalled, pytest.raises(PoolTimeout):
            pool.getconn()
        assert still_stalled()
        assert bound.cut >= 1
    finally:
        pool.close()


def test_a_commit_through_a_stalled_path_is_cut_off(locker, proxy):
    """COMMIT goes to psycopg directly, past the execute wrappers: bounded on its own."""
    from django.db import connections

    # A connection of its own to the test database through the proxy, outside the pool (a
    # pool is one per alias, shared with the test's own connection).
    own = connections.create_connection("default")
    own.settings_dict = {**own.settings_dict, "HOST": proxy.host, "PORT": str(proxy.port),
                         "OPTIONS": {k: v for k, v in own.settings_dict["OPTIONS"].items()
                                     if k != "pool"}}
    bound = QueryBound(1.0)
    bound.commit_bound(own)
    bound.commit_bound(own)  # once is enough
    try:
        own.set_autocommit(False)
        with own.cursor() as cursor:
            cursor.execute("SELECT 1")
        with stalled_for_a_while(proxy) as still_stalled, pytest.raises(OperationalError):
            own.commit()
        assert still_stalled()
        assert bound.cut == 1
    finally:
        own.close()


@pytest.fixture
def proxy():
    """A stall proxy (tests/stallproxy.py) in front of the test database's server."""
    from tests.stallproxy import StallProxy

    params = connection.get_connection_params()
    running = StallProxy(target_host=params.get("host") or "127.0.0.1",
                         target_port=int(params.get("port") or 5432)).start()
    try:
        yield running
    finally:
        running.stop()


@contextlib.contextmanager
def stalled_for_a_while(proxy) -> Iterator[Callable[[], bool]]:
    """Stall `proxy`, and let it move again only after 15 s, far past every bound here.
    Yields a function that says whether the path was still stalled when it was called: an
    answer that came only because the path moved would say False."""
    resumed = threading.Event()

    def resume() -> None:
        resumed.set()
        proxy.resume()

    answered: list[bool] = []
    proxy.stall()
    timer = threading.Timer(15, resume)
    timer.start()
    try:
        yield lambda: answered[0]
    finally:
        answered.append(not resumed.is_set())
        timer.cancel()
        proxy.resume()
