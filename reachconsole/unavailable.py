"""503 with Retry-After, never 500, while the database or Redis is down or the pool is spent.

A dependency that is down is not a bug in the console: the caller should wait and retry, and
the log should say so once a minute, not with a traceback per request. Only connection-level
failures count; an SQL error (a missing table, a deadlock) stays a 500 and is logged as one.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.signals import got_request_exception
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.html import escape

from reachconsole.core.outages import (
    DATABASE,
    DATABASE_WAIT,
    REDIS,
    unavailable_reason,
)

log = logging.getLogger(__name__)

RETRY_AFTER_S = 10
LOG_EVERY_S = 60.0

DETAILS = {
    DATABASE: "the console cannot reach its database (down, restarting or refusing "
              f"connections); try again in {RETRY_AFTER_S} s, and tell the console's "
              "operators if it lasts",
    # A pool timeout cannot tell a database that is down from one that is busy: the pool
    # counts the connections it is still trying to open as its own.
    DATABASE_WAIT: "the console waited too long for a database connection (the database is "
                   f"down, restarting or overloaded); try again in {RETRY_AFTER_S} s, and "
                   "tell the console's operators if it lasts",
    REDIS: "the console cannot reach Redis (its cache, event stream and task queue); "
           f"try again in {RETRY_AFTER_S} s, and tell the console's operators if it lasts",
}

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Console unavailable</title></head>
<body><h1>The console is unavailable for a moment</h1><p>{detail}.</p></body></html>
"""

def _pool_state() -> str:
    """For the log: whether the pool is full of busy connections or failing to open any."""
    pool = getattr(connection, "pool", None)  # PostgreSQL only
    if pool is None:
        return ""
    stats = pool.get_stats()
    return (f"; pool: {stats.get('pool_size', 0)} of {stats.get('pool_max', 0)} connections, "
            f"{stats.get('pool_available', 0)} idle, {stats.get('requests_waiting', 0)} "
            f"requests waiting, {stats.get('connections_errors', 0)} failed connects so far")


_last_logged: dict[str, float] = {}
_suppressed: dict[str, int] = {}
_log_lock = threading.Lock()


def _log_once_a_minute(reason: str, exc: BaseException, path: str) -> None:
    now = time.monotonic()
    with _log_lock:
        last = _last_logged.get(reason)
        if last is not None and now - last < LOG_EVERY_S:
            _suppressed[reason] = _suppressed.get(reason, 0) + 1
            return
        _last_logged[reason] = now
        more = _suppressed.pop(reason, 0)
    log.warning("%s unavailable, answering 503 (%s on %s; %d more 503s for this since the "
                "last line%s): %s", reason, type(exc).__name__, path, more,
                "" if reason == REDIS else _pool_state(), exc)


def unavailable_response(request: HttpRequest, exc: BaseException) -> HttpResponse | None:
    """The 503 for `exc` (JSON under /api/, a small page elsewhere), or None if it is not
    a dependency being down."""
    reason = unavailable_reason(exc)
    if reason is None:
        return None
    _log_once_a_minute(reason, exc, request.path)
    detail = DETAILS[reason]
    if request.path_info.startswith("/api/"):
        response = JsonResponse({"error": "unavailable", "detail": detail}, status=503)
    else:
        response = HttpResponse(PAGE.format(detail=escape(detail)), status=503,
                                content_type="text/html; charset=utf-8")
    response["Retry-After"] = str(RETRY_AFTER_S)
    response["Cache-Control"] = "no-store"
    # Django logs every 5xx with its request; the line above already said it, once a minute.
    response._has_been_logged = True
    return response


class _DropUnavailable(logging.Filter):
    """Keeps Django's per-request "Internal Server Error" traceback out of the log when the
    error is a dependency being down (raised in a middleware; the 500 becomes a 503)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return unavailable_reason(exc) is None


_ATTR = "_reach_unavailable"


def _remember(sender, request: HttpRequest | None = None, **kwargs) -> None:
    # Django turns an error raised in a later middleware into a 500 before it reaches us;
    # this signal fires while that error is being handled, so keep it on the request.
    exc = sys.exc_info()[1]
    if request is not None and unavailable_reason(exc) is not None:
        setattr(request, _ATTR, exc)


got_request_exception.connect(_remember, dispatch_uid="reachconsole.unavailable")


class UnavailableMiddleware:
    """Put right after SecurityMiddleware, so that it sees what every later middleware and
    every view raise. Sync and async: under ASGI it adds no thread hop of its own."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)
        request_log = logging.getLogger("django.request")
        if not any(isinstance(f, _DropUnavailable) for f in request_log.filters):
            request_log.addFilter(_DropUnavailable())

    def __call__(self, request: HttpRequest):
        if self.async_mode:
            return self.__acall__(request)
        return self._swapped(request, self.get_response(request))

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        return self._swapped(request, await self.get_response(request))

    def process_exception(self, request: HttpRequest, exception: Exception):
        return unavailable_response(request, exception)

    def _swapped(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        exc = getattr(request, _ATTR, None)
        if exc is not None and response.status_code == 500:
            return unavailable_response(request, exc) or response
        return response
