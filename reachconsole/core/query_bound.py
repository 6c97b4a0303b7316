"""A bound on every query a web process makes to PostgreSQL.

A database that stops answering without closing (a stalled network path, a NAT that dropped
the connection's state, a server stuck on I/O) leaves a query waiting on its socket for as
long as the stall lasts: the request, its thread and its pooled connection with it, and
behind them every request that waits for a connection. PostgreSQL's own timeouts cannot
help (its answer cannot arrive), and libpq has no timeout of its own for a query.

So a watchdog thread keeps the deadline of each query (and COMMIT, ROLLBACK, and the pool's
check of a connection) in flight, and one still running at its deadline has its
connection's socket shut down: it fails at once with a connection error, which answers 503
with Retry-After (reachconsole/unavailable.py); the pool discards the broken connection, and
the server rolls an open transaction back when it notices. A transaction cut off before its
COMMIT was sent leaves nothing; one cut off while its COMMIT (or an autocommit write) was
already on its way may have committed, as with any connection lost at that moment: the
caller is told 503 and its retry meets the console's idempotency (the same taskId, the
same idempotency key) rather than a second row.

Only web processes install it (reachconsole/asgi.py): the bridge waits out a stall instead,
acknowledging nothing it has not stored, so the broker keeps it. SQLite has no network path
to stall and is left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

from django.conf import settings
from django.db.backends.signals import connection_created

log = logging.getLogger(__name__)
LOG_EVERY_S = 60.0


class QueryBound:
    """An execute wrapper (Django's `connection.execute_wrappers`) and the watchdog it
    reports to."""

    def __init__(self, bound_s: float):
        self.bound_s = bound_s
        self.active = True  # False once uninstalled: wrappers already placed let queries be
        self.cut = 0  # queries cut off so far
        self._lock = threading.Lock()
        # The watchdog sleeps until the earliest deadline, or until a query starts when none
        # runs: a web process that makes no query costs it no wake-up at all.
        self._wake = threading.Condition(self._lock)
        self._sleeping_until: float | None = None  # None: until the next query starts
        self._wake_count = 0  # how often it has looked, for the tests
        self._running: dict[int, tuple[float, int]] = {}  # token → (deadline, socket fd)
        self._next = 0
        self._thread: threading.Thread | None = None
        self._logged_at = 0.0

    def __call__(self, execute, sql, params, many, context):
        with self.watching(context["connection"].connection):
            return execute(sql, params, many, context)

    @contextlib.contextmanager
    def watching(self, raw) -> Iterator[None]:
        """Cut `raw` (a psycopg connection) off if the block has not ended at the bound."""
        if not self.active:
            yield
            return
        try:
            # A descriptor of our own for the socket: libpq may close its own while the
            # query fails (a reset), and that number may then be given to another socket.
            fd = os.dup(raw.fileno())
        except Exception:  # noqa: BLE001  (no socket: let the query say what is wrong)
            yield
            return
        with self._lock:
            self._next += 1
            token = self._next
            deadline = time.monotonic() + self.bound_s
            self._running[token] = (deadline, fd)
            self._watch()
            # Woken only when this deadline comes before the one it sleeps for: with one
            # bound for all, only the first query after an idle spell wakes it.
            if self._sleeping_until is None or deadline < self._sleeping_until:
                self._wake.notify()
        try:
            yield
        finally:
            with self._lock:
                self._running.pop(token, None)
            os.close(fd)

    def commit_bound(self, connection) -> None:
        """COMMIT and ROLLBACK go to psycopg directly, past the execute wrappers; through a
        stalled path they wait as a query does."""
        for name in ("_commit", "_rollback"):
            method = getattr(connection, name)
            if getattr(method, "bounded_by", None) is self:
                continue

            def bounded(method=method):
                raw = connection.connection
                if raw is None:
                    return method()
                with self.watching(raw):
                    return method()

            bounded.bounded_by = self
            setattr(connection, name, bounded)

    def pool_check_bound(self, pool) -> None:
        """The pool checks a connection before handing it out (CONN_HEALTH_CHECKS), on the
        socket, outside any query: through a stalled path that check waits too. Bounded
        the same way, a cut-off check makes the pool discard that connection and try
        another, until its own timeout answers 503. psycopg_pool takes the check only when
        made (Django makes it); `_check` is where it keeps it."""
        check = getattr(pool, "_check", None)
        if check is None or getattr(check, "bounded_by", None) is self:
            return

        def bounded_check(conn) -> None:
            with self.watching(conn):
                check(conn)

        bounded_check.bounded_by = self
        pool._check = bounded_check

    def _watch(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="query-bound", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        with self._lock:
            while True:
                self._wake_count += 1
                now = time.monotonic()
                # Under the lock: a query that has returned is no longer here, so a socket
                # is only ever shut down while its query still waits on it (never after the
                # pool has handed the connection to someone else).
                late = [token for token, (deadline, _) in self._running.items()
                        if deadline <= now]
                for token in late:
                    _, fd = self._running.pop(token)
                    self._shut(fd)
                # The earliest deadline is the oldest query's; those that ended before it
                # cost one wake-up that finds nothing late.
                self._sleeping_until = min(
                    (deadline for deadline, _ in self._running.values()), default=None)
                self._wake.wait(None if self._sleeping_until is None
                                else self._sleeping_until - now)

    def _shut(self, fd: int) -> None:
        self.cut += 1
        try:
            # Shutting our descriptor's socket down ends the connection for the blocked
            # reader too (one socket); it is closed by the block that opened it.
            sock = socket.socket(fileno=fd)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.detach()
        except OSError as exc:
            log.debug("cutting off a late query's connection failed: %s", exc)
            return
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.warning("a database query did not finish within %.1f s "
                        "(REACH_DB_QUERY_BOUND_S): its connection was cut off and the request "
                        "answered 503 (a stalled connection, or the database stuck); %d cut "
                        "off in this process so far", self.bound_s, self.cut)


_installed: QueryBound | None = None


def _on_connection(sender, connection, **kwargs) -> None:
    # On a connection, not at the install: the pool must be made with the settings of its
    # first use (a test run renames the database after importing reachconsole.asgi).
    if _installed is None or connection.vendor != "postgresql":
        return
    if _installed not in connection.execute_wrappers:
        connection.execute_wrappers.insert(0, _installed)
    _installed.commit_bound(connection)
    pool = getattr(connection, "pool", None)
    if pool is not None:
        _installed.pool_check_bound(pool)


def query_bound_install() -> QueryBound | None:
    """Bound every query of this process (REACH_DB_QUERY_BOUND_S; 0 turns it off)."""
    global _installed
    bound_s = settings.REACH_DB_QUERY_BOUND_S
    if not bound_s:
        return None
    if _installed is None:
        _installed = QueryBound(bound_s)
        connection_created.connect(_on_connection, dispatch_uid="reachconsole.query_bound")
    return _installed


def query_bound_uninstall() -> None:
    """For a process that imported reachconsole.asgi without serving it (the test suite)."""
    global _installed
    connection_created.disconnect(dispatch_uid="reachconsole.query_bound")
    if _installed is not None:
        _installed.active = False  # also where it was placed already
    _installed = None
