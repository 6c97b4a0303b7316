"""Which failures mean "a dependency is unavailable" (the database down or its pool spent,
Redis down), as opposed to a bug: the 503 of reachconsole/unavailable.py and any code that
must wait out an outage instead of failing (messages/waits.py) ask the same question here.
Only connection-level failures count; an SQL error (a missing table, a deadlock) does not.
"""

from __future__ import annotations

import sqlite3

import kombu.exceptions
import psycopg
import psycopg_pool
import redis.exceptions
from django.db import InterfaceError, OperationalError, connections

DATABASE = "database"
DATABASE_WAIT = "database-wait"
REDIS = "redis"

# PostgreSQL SQLSTATE classes of "cannot talk to the server" (08: connection exception,
# 53: out of resources such as "too many clients", 57P0x: shutting down or starting up).
_PG_DOWN_PREFIXES = ("08", "53", "57P01", "57P02", "57P03")
_SQLITE_DOWN = ("unable to open database file", "disk i/o error")
_SQLITE_BUSY = ("database is locked",)


_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                 kombu.exceptions.OperationalError)  # kombu's: the Celery broker (Redis)
# What may mean "unavailable"; unavailable_reason() decides for each instance.
UNAVAILABLE_ERRORS = (OperationalError, InterfaceError, *_REDIS_ERRORS)


def unavailable_reason(exc: BaseException | None) -> str | None:
    """Which dependency `exc` says is unavailable, or None when it is some other error."""
    if isinstance(exc, _REDIS_ERRORS):
        return REDIS
    if isinstance(exc, InterfaceError):
        return DATABASE
    if not isinstance(exc, OperationalError):
        return None
    cause = exc.__cause__
    if isinstance(cause, psycopg_pool.PoolTimeout | psycopg_pool.TooManyRequests):
        return DATABASE_WAIT
    if isinstance(cause, psycopg_pool.PoolClosed):
        return DATABASE
    if isinstance(cause, psycopg.OperationalError):
        state = cause.sqlstate
        return DATABASE if state is None or state.startswith(_PG_DOWN_PREFIXES) else None
    if isinstance(cause, sqlite3.OperationalError):
        text = str(cause).lower()
        if text.startswith(_SQLITE_BUSY):
            return DATABASE_WAIT
        return DATABASE if text.startswith(_SQLITE_DOWN) else None
    return None


def database_unanswered(alias: str = "default") -> str:
    """"" when this thread's connection to the database `alias` answers a round trip, else
    why not, in the driver's words: what readiness reports, and what tells a bridge that
    cannot reach its ingest lock whether the database itself is away
    (messages/ingest_lock.py)."""
    db = connections[alias]
    try:
        if db.errors_occurred:
            db.close_if_unusable_or_obsolete()  # a broken connection is not asked again
        with db.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
        return ""
    except Exception as exc:  # noqa: BLE001 - any driver error means "does not answer"
        return f"{type(exc).__name__}: {exc}"
