"""Which bridge ingests when the broker cannot share subscriptions (MQTT 3.1.1, or a broker
that says SharedSubscriptionAvailable = 0).

Every bridge keeps publishing the outbox (its claims are guarded), but only the holder of
this lock subscribes to the inbound topics: two plain subscriptions would have every message
delivered, decoded and inserted twice. The lock is a PostgreSQL session advisory lock taken
on a connection of its own, not the thread's ORM connection (which may be closed and taken
again after an error, silently dropping the lock). PostgreSQL releases it the moment that
connection ends, so a standby takes over within a second of the holder dying (SIGKILL, a
lost network), with no TTL to wait out.

SQLite (the embedded single-process mode) has no second process to share with: there the
lock is always held.

When the held lock's connection fails, `hold()` asks for the lock again on a fresh one at
once: after a PostgreSQL restart the database usually answers again before the bridge
notices, and the lock is free. When that connection fails, `hold()` tells two cases apart.
If the bridge's own connection to the database fails too, the database is away: nobody
stores anything then, and nobody can be known to hold the lock (UNKNOWN). If the database
answers the bridge, the lock's connection alone was refused (too many clients): that is no
outage, and the bridge must act as one without the lock (NOT_HELD), or two bridges could
ingest.
"""

from __future__ import annotations

import enum
import hashlib
import logging

from django.db import connections

from reachconsole.core.outages import database_unanswered

log = logging.getLogger(__name__)

# libpq parameters of DATABASES["default"]["OPTIONS"] that matter to a plain connection
# (the pool's own options are not libpq's).
_LIBPQ_OPTIONS = ("sslmode", "sslrootcert", "sslcert", "sslkey", "sslpassword",
                  "target_session_attrs", "options")


def lock_key(name: str) -> int:
    """A signed 64-bit advisory-lock key for `name` (one per share group: one per console)."""
    return int.from_bytes(hashlib.sha256(f"reach-ingest:{name}".encode()).digest()[:8],
                          "big", signed=True)


class Hold(enum.Enum):
    HELD = "held"
    NOT_HELD = "not held"  # another bridge holds it, or its connection alone was refused
    UNKNOWN = "unknown"  # the database is away: nobody can be known to hold it


class IngestLock:
    """`hold()` (owner thread, every second or so) tries to take the lock, or checks that the
    one held is still held; `release()` lets it go. `unreachable`: why the lock's own
    connection failed on the last `hold()` ("" when it answered)."""

    def __init__(self, *, name: str, alias: str = "default"):
        self.name = name
        self.key = lock_key(name)
        self.alias = alias
        self._conn = None  # psycopg connection holding the lock; None when not held
        self.unreachable = ""
        self.vendor = connections[alias].vendor
        self.what = ("none needed: SQLite runs one process" if self.vendor != "postgresql"
                     else f"PostgreSQL advisory lock {self.key}")

    @property
    def held(self) -> bool:
        return self.vendor != "postgresql" or self._conn is not None

    def hold(self) -> Hold:
        """Whether this bridge holds the lock now (see the module's docstring). Never raises
        for a database outage. Asks the bridge's own connection (this thread's) only when
        the lock's failed."""
        if self.vendor != "postgresql":
            return Hold.HELD
        import psycopg

        self.unreachable = ""
        try:
            if self._conn is not None:
                try:
                    # A round trip proves the session (and so the lock) is still alive.
                    self._conn.execute("SELECT 1")
                    return Hold.HELD
                except psycopg.Error as exc:
                    # Its session ended (a PostgreSQL restart, a terminated backend): asked
                    # for again at once, below. Answering NOT_HELD first would have the
                    # bridge unsubscribe and subscribe again a second later, and what the
                    # other nodes published in between would match no subscriber.
                    log.warning("lost the ingest lock with its database connection (%s): "
                                "asking for it again", str(exc).strip() or type(exc).__name__)
                    self._drop()
            conn = psycopg.connect(**self._params(), autocommit=True, connect_timeout=5)
            try:
                row = conn.execute("SELECT pg_try_advisory_lock(%s)", (self.key,)).fetchone()
            except psycopg.Error:
                conn.close()
                raise
            if row and row[0]:
                self._conn = conn
                return Hold.HELD
            conn.close()
            return Hold.NOT_HELD
        except psycopg.Error as exc:
            self.unreachable = str(exc).strip() or type(exc).__name__
            self._drop()
            return Hold.UNKNOWN if database_unanswered(self.alias) else Hold.NOT_HELD

    def release(self) -> None:
        if self._conn is None:
            return
        try:
            self._conn.execute("SELECT pg_advisory_unlock(%s)", (self.key,))
        except Exception as exc:  # noqa: BLE001 - closing the connection releases it anyway
            log.debug("advisory unlock failed (%s); closing the connection releases it", exc)
        self._drop()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001, S110 - already broken; nothing to release
                pass

    def _params(self) -> dict:
        db = connections[self.alias].settings_dict
        params = {"dbname": db["NAME"], "user": db.get("USER") or None,
                  "password": db.get("PASSWORD") or None, "host": db.get("HOST") or None,
                  "port": db.get("PORT") or None, "application_name": "reach-ingest-lock",
                  # A half-open TCP connection must not keep a dead holder "holding".
                  "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
                  "keepalives_count": 3}
        options = db.get("OPTIONS") or {}
        params.update({k: options[k] for k in _LIBPQ_OPTIONS if k in options})
        return {k: v for k, v in params.items() if v is not None}
