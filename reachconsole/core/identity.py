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

Read once a process, when first needed (or at a process's start: console_id_warm), in a
thread of its own: callers include the channel layer on Daphne's event loop, where the ORM
refuses to run. While the database cannot be read the name is not known, and callers get
the database's error (for a few seconds without asking again, so an event loop is not held
up by one connection attempt after another).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time

from django.conf import settings
from django.db import DatabaseError, connections

log = logging.getLogger(__name__)
_lock = threading.Lock()
_resolved: str | None = None
_failed: tuple[float, BaseException] | None = None  # when the last read failed, and why
RETRY_AFTER_S = 2.0


def _after_fork_in_child() -> None:
    # A worker's pool forks children at any time: one forked while another thread held the
    # lock (waiting on a database that is down) would wait on it for ever.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def database_facts(alias: str = "default") -> str:
    """What identifies the database itself, as text (no address in it)."""
    connection = connections[alias]
    if connection.vendor == "sqlite":
        name = str(connection.settings_dict["NAME"])
        if name == ":memory:" or "mode=memory" in name:
            return f"sqlite-memory:{os.getpid()}"  # one process's own database
        return f"sqlite:{os.path.realpath(name)}"
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_database(), "
                       "(SELECT oid FROM pg_database WHERE datname = current_database())")
        name, oid = cursor.fetchone()
        try:
            cursor.execute("SELECT system_identifier::text FROM pg_control_system()")
            cluster = cursor.fetchone()[0]
        except DatabaseError:
            # A role that may not read it (some managed services): the server's own view
            # of where it listens, which the client's spelling does not change.
            cursor.execute("SELECT coalesce(host(inet_server_addr()), 'local') || ':' || "
                           "coalesce(inet_server_port(), 0)")
            cluster = cursor.fetchone()[0]
    return f"postgresql:{cluster}/{name}/{oid}"


def identity_from(facts: str) -> str:
    return "reach-" + hashlib.sha256(facts.encode()).hexdigest()[:12]


def address_identity(db: dict) -> str:
    """The name consoles had before (a hash of how the address was spelled): bridges end the
    broker sessions they left under it (messages/bridge.py legacy_client_ids)."""
    where = f"{db.get('HOST') or ''}:{db.get('PORT') or ''}/{db.get('NAME')}"
    return "reach-" + hashlib.sha256(where.encode()).hexdigest()[:12]


def _read() -> None:
    global _resolved
    try:
        _resolved = identity_from(database_facts())
    finally:
        # A thread of its own: give its connection back rather than leave it open.
        connections.close_all()


def console_id(*, retry: bool = False) -> str:
    """The console's name: `REACH_CONSOLE_ID`, else derived from its database (read once a
    process). Raises the database's error while it cannot be read (`retry`: ask again at
    once, not after RETRY_AFTER_S)."""
    global _failed
    if settings.REACH_CONSOLE_ID:
        return settings.REACH_CONSOLE_ID
    if _resolved is not None:
        return _resolved
    with _lock:
        if _resolved is None:
            if (not retry and _failed is not None
                    and time.monotonic() - _failed[0] < RETRY_AFTER_S):
                raise _failed[1]
            failure: list[BaseException] = []

            def read() -> None:
                try:
                    _read()
                except BaseException as exc:  # noqa: BLE001  (re-raised in the caller)
                    failure.append(exc)

            thread = threading.Thread(target=read, name="console-identity", daemon=True)
            thread.start()
            thread.join()
            if failure:
                _failed = (time.monotonic(), failure[0])
                raise failure[0]
            _failed = None
    assert _resolved is not None
    return _resolved


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
