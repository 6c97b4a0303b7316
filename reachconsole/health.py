"""Liveness and readiness for load balancers and orchestrators."""

from __future__ import annotations

import time

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from reachconsole.core.metrics import prometheus_text


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


def _check_broker() -> tuple[bool, str]:
    """A bridge (in any worker) is connected to the broker and its writes commit: the
    console hears the bus and can publish. A broker that only accepts TCP is not enough."""
    from roster.hearing import bridges_hearing

    try:
        live = bridges_hearing()
    except Exception as exc:
        return False, f"cannot tell (database: {type(exc).__name__})"
    if not live:
        return False, ("no MQTT bridge hears the bus: is a Celery worker running "
                       "(REACH_BRIDGE=1), and can it reach MQTT_URL?")
    names = ", ".join(row.instance for row in live)
    return True, f"{len(live)} bridge(s) hear the bus: {names}"


@require_GET
@never_cache
def readyz(request: HttpRequest) -> JsonResponse:
    started = time.monotonic()
    checks = {}
    for name, check in (("database", _check_database), ("redis", _check_redis),
                        ("broker", _check_broker)):
        ok, detail = check()
        checks[name] = {"ok": ok, "detail": detail}
    ready = all(item["ok"] for item in checks.values())
    body = {
        "status": "ready" if ready else "not ready",
        "checks": checks,
        "elapsedMs": round((time.monotonic() - started) * 1000, 1),
    }
    return JsonResponse(body, status=200 if ready else 503)


@require_GET
@never_cache
def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus text format: counters shared through the cache, and which bridges hear."""
    from roster.hearing import bridges_hearing

    gauges = {f'reach_bridge_connected{{instance="{row.instance}"}}': 1
              for row in bridges_hearing()}
    return HttpResponse(prometheus_text(gauges), content_type="text/plain; version=0.0.4")
