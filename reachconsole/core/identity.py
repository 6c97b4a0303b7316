"""The console's identity: one name per console, whichever process asks and however it
spells its database's address.

It keeps consoles that share a Redis server or a broker apart: the channel layer's and the
cache's key prefixes, the bridges' client ids and their shared-subscription group carry it.
Processes of one console must agree on it, so it is read from the console's database itself,
not from the address each process was given (a second Daphne pointed at `localhost`
instead of `127.0.0.1` became another console and saw no events): on PostgreSQL the
cluster's system identifier (`pg_control_system()`, set once by initdb) with the database's
name and oid; on SQLite the file's real path. Nothing is written, so nothing a test's flush
or a restore can take away; a copy of the database on another cluster, or under another
name, is another console. `REACH_CONSOLE_ID` names it outright and is then the only word.

Read once a process, when first needed (or at a process's start: console_id_warm). On an
event loop (the channel layer on Daphne's) it is never waited for:
an unknown name is read in the background and the caller told the database has not
answered. While the database cannot be read the name is not known, and callers get the
database's error (for a few seconds without asking again).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time

from django.conf import settings
from django.db import OperationalError, connections

log = logging.getLogger(__name__)
_lock = threading.Lock()
_resolved: str | None = None
_failed: tuple[float, BaseException] | None = None  # when the last read failed, and why
RETRY_AFTER_S = 2.0
CONNECT_TIMEOUT_S = 5  # unless the database's OPTIONS say otherwise


def _after_fork_in_child() -> None:
    # A worker's pool forks children at any time: one forked while another thread held the
    # lock (waiting on a database that is down) would wait on it for ever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def database_facts(alias: str = "default") -> str:
    """What identifies the database itself, as text (no address in it).

    Read on a connection of its own, made and closed here, never through Django's connection
    handler: that would create the process's connection pool with the settings of this
    moment (a test run renames the database afterwards, and the pool would keep the old
    name), and it refuses to run on an event loop's thread."""
    connection = connections[alias]
    if connection.vendor == "sqlite":
        name = str(connection.settings_dict["NAME"])
        if name == ":memory:" or "mode=memory" in name:
            return f"sqlite-memory:{os.getpid()}"  # one process's own database
        return f"sqlite:{os.path.realpath(name)}"
    import psycopg

    params = connection.get_connection_params()
    params.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
    with connection.wrap_database_errors, psycopg.connect(**params, autocommit=True) as conn:
        name, oid = conn.execute(
            "SELECT current_database(), "
            "(SELECT oid FROM pg_database WHERE datname = current_database())").fetchone()
        try:
            cluster = conn.execute(
                "SELECT system_identifier::text FROM pg_control_system()").fetchone()[0]
        except psycopg.errors.InsufficientPrivilege as exc:
            # A role that may not read it (some managed services): the server's own view
            # of where it listens. Weaker (an IPv6 or a socket connection is seen elsewhere),
            # so said: such a console should name itself.
            log.warning("cannot read PostgreSQL's system identifier (%s): the console's name "
                        "comes from the server's listen address; set REACH_CONSOLE_ID so "
                        "every process agrees whatever way it connects", exc)
            cluster = conn.execute(
                "SELECT coalesce(host(inet_server_addr()), 'local') || ':' || "
                "coalesce(inet_server_port(), 0)").fetchone()[0]
    return f"postgresql:{cluster}/{name}/{oid}"


def identity_from(facts: str) -> str:
    return "reach-" + hashlib.sha256(facts.encode()).hexdigest()[:12]


def address_identity(db: dict) -> str:
    """The name consoles had before (a hash of how the address was spelled): bridges end the
    broker sessions they left under it (messages/client_ids.py legacy_client_ids)."""
    where = f"{db.get('HOST') or ''}:{db.get('PORT') or ''}/{db.get('NAME')}"
    return "reach-" + hashlib.sha256(where.encode()).hexdigest()[:12]


def _read() -> None:
    global _resolved
    facts = database_facts()
    _resolved = identity_from(facts)
    log.info("the console's name is %s (from its database: %s)", _resolved, facts)


def console_id(*, retry: bool = False) -> str:
    """The console's name: `REACH_CONSOLE_ID`, else derived from its database (read once a
    process). Raises the database's error while it cannot be read (`retry`: ask again at
    once, not after RETRY_AFTER_S)."""
    if settings.REACH_CONSOLE_ID:
        return settings.REACH_CONSOLE_ID
    if _resolved is not None:
        return _resolved
    if _on_event_loop():
        # Never wait on an event loop: a database that does not answer would hold up every
        # socket of the process for a connect timeout. Read in the background; the caller
        # is told the database is not there yet, as a read would have told it.
        _read_in_background()
        import psycopg

        # With a driver's connection error as its cause, as a read would raise: what answers
        # 503, not 500 (reachconsole/core/outages.py).
        raise OperationalError("the console's name is not known yet: it is read from the "
                               "database, which has not answered since this process started"
                               ) from psycopg.OperationalError("not read yet")
    with _lock:
        if _resolved is None:
            if (not retry and _failed is not None
                    and time.monotonic() - _failed[0] < RETRY_AFTER_S):
                raise _fresh(_failed[1])
            _read_once()
            if _resolved is None:
                assert _failed is not None
                raise _fresh(_failed[1])
    assert _resolved is not None
    return _resolved


def _fresh(exc: BaseException) -> BaseException:
    """A copy of a remembered failure for each caller: one object raised again and again, from
    many threads, would grow its traceback with every raise and keep their frames alive."""
    try:
        copy = type(exc)(*exc.args)
    except Exception:  # noqa: BLE001  (an error that cannot be made again: the same one)
        return exc
    copy.__cause__ = exc.__cause__
    return copy


def _read_once() -> None:
    global _failed
    try:
        _read()
        _failed = None
    except BaseException as exc:  # noqa: BLE001  (raised again in the caller)
        _failed = (time.monotonic(), exc)


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


_background: threading.Thread | None = None


def _read_in_background() -> None:
    global _background
    with _lock:
        if _resolved is None and (_background is None or not _background.is_alive()):
            _background = threading.Thread(target=_read_once, name="console-identity",
                                           daemon=True)
            _background.start()


def console_id_forget() -> None:
    """Read the name again when next asked: for a process whose database settings changed
    after it was read (a test run creates its test database after collecting the tests,
    some of which import reachconsole.asgi, which reads it)."""
    global _resolved, _failed
    with _lock:
        _resolved = None
        _failed = None


def console_id_warm() -> bool:
    """Read the name now, at a process's start, rather than on its first event (Daphne's
    event loop would wait on that read); a database not up yet is read later instead."""
    try:
        console_id()
    except Exception as exc:  # noqa: BLE001  (any database error: read on first use)
        log.warning("the console's identity is not known yet (the database: %s); it is read "
                    "once the database answers", exc)
        return False
    return True


def console_id_wait(stop: threading.Event, *, most_s: float = 10.0) -> str | None:
    """The name, waiting for the database as long as it takes (None once `stop` is set): a
    worker started while the database is down starts its bridge when it is back."""
    delay = 0.5
    while not stop.is_set():
        if console_id_warm():
            return console_id()
        stop.wait(delay)
        delay = min(delay * 2, most_s)
    return None


def cache_key(key: str, key_prefix: str, version: int) -> str:
    """Django's default key, prefixed with the console's name (CACHES' KEY_FUNCTION): the
    name is not known when settings load, only once the database can be read."""
    return f"{key_prefix or console_id()}:{version}:{key}"
