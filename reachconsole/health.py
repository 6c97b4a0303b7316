"""Liveness and readiness for load balancers and orchestrators."""

from __future__ import annotations

import time

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET


@require_GET
@never_cache
def healthz(request: HttpRequest) -> JsonResponse:
    """The process answers. Nothing else is checked: a restart would not fix a broker."""
    return JsonResponse({"status": "ok"})


def _check_database() -> tuple[bool, str]:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
        return True, connection.vendor
    except Exception as exc:  # any driver error means "not ready", with its words
        return False, f"{type(exc).__name__}: {exc}"


def _check_redis() -> tuple[bool, str]:
    if not settings.REDIS_URL:
        return True, "embedded (in-memory)"
    import redis

    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1.0)
        client.ping()
        return True, "redis"
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"


@require_GET
@never_cache
def readyz(request: HttpRequest) -> JsonResponse:
    started = time.monotonic()
    checks = {}
    for name, check in (("database", _check_database), ("redis", _check_redis)):
        ok, detail = check()
        checks[name] = {"ok": ok, "detail": detail}
    ready = all(item["ok"] for item in checks.values())
    body = {
        "status": "ready" if ready else "not ready",
        "checks": checks,
        "elapsedMs": round((time.monotonic() - started) * 1000, 1),
    }
    return JsonResponse(body, status=200 if ready else 503)
