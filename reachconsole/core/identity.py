"""The console's identity: one name per console, whichever process asks and however it
spells its database's address.

It keeps consoles that share a Redis server or a broker apart: the channel layer's and the
cache's key prefixes, the bridges' client ids and their shared-subscription group carry it.
Processes of one console must agree on it, so it is a row of the console's own database
(`ConsoleIdentity`), not a hash of the address each process was given (a second Daphne
pointed at `localhost` instead of `127.0.0.1` became another console and saw no events).
`REACH_CONSOLE_ID` names it outright and is then the only word.

The row is written by `migrate` (core/migrations/0003), or by the first process that asks
if it is missing, with the name the address-derived scheme gave: a console that upgrades
keeps the identity (and the broker sessions and Redis keys) it had.
"""

from __future__ import annotations

import hashlib
import logging
import threading

from django.conf import settings
from django.db import models

log = logging.getLogger(__name__)
_lock = threading.Lock()
_resolved: str | None = None


class ConsoleIdentity(models.Model):
    """One row: the console's name (`console_id`)."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    name = models.CharField(max_length=40)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        app_label = "core"
        db_table = "reach_console_identity"
        verbose_name_plural = "console identity"

    def __str__(self) -> str:
        return self.name


def address_identity(db: dict) -> str:
    """The name derived from how a process spells its database's address: what the row
    starts with (see the module's words), and nothing more."""
    where = f"{db.get('HOST') or ''}:{db.get('PORT') or ''}/{db.get('NAME')}"
    return "reach-" + hashlib.sha256(where.encode()).hexdigest()[:12]


def _row_read() -> None:
    global _resolved
    from django.db import connections

    try:
        row, _ = ConsoleIdentity.objects.get_or_create(
            pk=1, defaults={"name": address_identity(settings.DATABASES["default"])})
        _resolved = row.name
    finally:
        # A thread of its own: give its connection back rather than leave it open.
        connections.close_all()


def console_id() -> str:
    """The console's name: `REACH_CONSOLE_ID`, else its database's identity row (read once
    a process, created by the first process to ask). Raises the database's error while the
    database cannot be read; nothing is remembered then, so the next call tries again."""
    if settings.REACH_CONSOLE_ID:
        return settings.REACH_CONSOLE_ID
    if _resolved is not None:
        return _resolved
    with _lock:
        if _resolved is None:
            # Read in a thread of its own: callers include the channel layer on an event
            # loop, where the ORM refuses to run (and one short read a process may block it).
            failure: list[BaseException] = []

            def read() -> None:
                try:
                    _row_read()
                except BaseException as exc:  # noqa: BLE001  (re-raised in the caller)
                    failure.append(exc)

            thread = threading.Thread(target=read, name="console-identity", daemon=True)
            thread.start()
            thread.join()
            if failure:
                raise failure[0]
    assert _resolved is not None
    return _resolved


def console_id_warm() -> None:
    """Read the name now, at a process's start, rather than on its first event (Daphne's
    event loop would wait on that read); a database not up yet is read later instead."""
    try:
        console_id()
    except Exception as exc:  # noqa: BLE001  (any database error: read on first use)
        log.warning("console identity not read at start (%s): it is read on first use", exc)


def cache_key(key: str, key_prefix: str, version: int) -> str:
    """Django's default key, prefixed with the console's name (CACHES' KEY_FUNCTION): the
    name is not known when settings load, only once the database can be read."""
    return f"{key_prefix or console_id()}:{version}:{key}"
