"""The header's count of active, unacknowledged alarms, on every page (templates/base.html).

Lazy: read only when a template shows it (the header), so the htmx partials that refresh
every few seconds cost no query. A bounded read of ids on the partial index of active
alarms, not a COUNT: the console's pages count nothing (tests/test_timeline.py).
"""

from __future__ import annotations

import logging
import time
from functools import cached_property

from django.db import connection, transaction
from django.http import HttpRequest

log = logging.getLogger(__name__)

# More than this many shows as "99+": enough to say "many", and the read stays bounded.
SHOWN_UP_TO = 99
_WARN_EVERY_S = 60.0
_warned_at = -_WARN_EVERY_S


class AlarmsHeader:
    @cached_property
    def count(self) -> int | None:
        """Active alarms nobody acknowledged, up to SHOWN_UP_TO + 1; None when the database
        cannot be read (the page still renders, without the count)."""
        global _warned_at
        from alarms.selectors import unacknowledged_ids

        try:
            if connection.in_atomic_block:
                # A savepoint: on PostgreSQL a failed read would otherwise abort the
                # transaction the rest of the page runs in.
                with transaction.atomic():
                    return len(unacknowledged_ids(limit=SHOWN_UP_TO + 1))
            return len(unacknowledged_ids(limit=SHOWN_UP_TO + 1))
        except Exception as exc:  # a database hiccup must not fail the page it decorates
            now = time.monotonic()
            if now - _warned_at >= _WARN_EVERY_S:
                _warned_at = now
                log.warning("the header's alarm count could not be read (%s: %s); pages are "
                            "shown without it", type(exc).__name__, exc)
            return None

    @property
    def shown(self) -> str:
        n = self.count
        if not n:
            return ""
        return f"{SHOWN_UP_TO}+" if n > SHOWN_UP_TO else str(n)


def alarms_header(request: HttpRequest) -> dict:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    return {"alarms_header": AlarmsHeader()}
