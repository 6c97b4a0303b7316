"""Liveness and readiness for load balancers and orchestrators."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from reachconsole.metrics import prometheus_text


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
    from messages import runtime

    bridge = runtime.current_bridge()
    if bridge is not None:
        state = "connected" if bridge.connected.is_set() else "disconnected"
        return bridge.connected.is_set(), f"bridge {state} to {bridge.url}"
    if not settings.MQTT_URL:
        return True, "embedded broker starts with the console"
    parsed = urlparse(settings.MQTT_URL)
    try:
        with socket.create_connection((parsed.hostname, parsed.port or 1883), timeout=1.0):
            return True, f"reachable at {parsed.hostname}:{parsed.port or 1883}"
    except OSError as exc:
        return False, f"{settings.MQTT_URL}: {exc}"


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
    """Prometheus text format: counters shared through the cache, plus this process's gauges."""
    from messages import runtime

    gauges = {}
    bridge = runtime.current_bridge()
    if bridge is not None:
        stats = bridge.stats()
        gauges = {"reach_bridge_connected": int(stats["connected"]),
                  "reach_bridge_queued": stats["queued"],
                  "reach_bridge_pending_pubacks": stats["pending_pubacks"]}
    return HttpResponse(prometheus_text(gauges), content_type="text/plain; version=0.0.4")
