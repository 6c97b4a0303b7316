"""The broker's own word that it dropped messages: one note, one key, every reader.

Mosquitto counts the messages it drops (queues full, a subscriber too slow) in `$SYS`, the only
place such losses show. The MQTT bridge (messages/mqtt_session.py, in a worker) notes each increase
here; the roster's and the overview's pages (in Daphne) and the alarms' evaluation (in beat)
read it back. Kept in the cache because those are other processes; in the kernel because the
roster, which every app sits above, reads it too.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.cache import cache

KEY = "broker-drops"
SHOWN_S = 3600  # how long the pages and the alarm show it after the last drop


def broker_drops_note(*, dropped: int, total: int, now: datetime) -> None:
    cache.set(KEY, {"dropped": dropped, "total": total, "at": now.isoformat()}, timeout=SHOWN_S)


def broker_drops_read() -> dict[str, Any] | None:
    """The last increase ({dropped, total, at}) while it is shown, else None. Raises what the
    cache raises when it is down: a caller that can say "unknown" should."""
    return cache.get(KEY)


def broker_drops_forget() -> None:
    cache.delete(KEY)
