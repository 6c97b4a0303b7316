"""Liveness and readiness for load balancers and orchestrators."""

from __future__ import annotations

import time

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client.exposition import choose_encoder

from reachconsole.collector import registry
from reachconsole.core.metrics import FLUSH_EVERY_S, DeliveryRate, delivery_rate
from reachconsole.core.outages import database_unanswered


@require_GET
@never_cache
def healthz(request: HttpRequest) -> JsonResponse:
    """The process answers. Nothing else is checked: a restart would not fix a broker."""
    return JsonResponse({"status": "ok"})


def _check_database() -> tuple[bool, str]:
    unanswered = database_unanswered()  # any driver error means "not ready", with its words
    return (False, unanswered) if unanswered else (True, connection.vendor)


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


def broker_check() -> tuple[bool, str]:
    """A bridge (in any worker) is connected to the broker and its writes commit: the
    console hears the bus and can publish. A broker that only accepts TCP is not enough."""
    from roster.hearing import bridges_hearing

    try:
        live = bridges_hearing()
    except Exception as exc:
        return False, f"cannot tell (database: {type(exc).__name__})"
    if not live:
        from roster.hearing import bridges_gone_quiet

        quiet = bridges_gone_quiet()
        if quiet:
            now = timezone.now()
            return False, "no MQTT bridge hears the bus: " + "; ".join(
                f"{row.instance} was connected, but its probe last came back "
                f"{(now - row.heard_at).total_seconds():.0f} s ago (a stalled connection, or "
                "its database writes hang; it reconnects after MQTT_KEEPALIVE_S)"
                for row in quiet)
        # The bridges say why they cannot connect (wrong password, untrusted certificate…).
        from messages.broker_caps import connect_errors

        errors = connect_errors()
        if errors:
            return False, "no MQTT bridge hears the bus: " + "; ".join(errors)
        return False, ("no MQTT bridge hears the bus: is a Celery worker running "
                       "(REACH_BRIDGE=1), and can it reach MQTT_URL?")
    names = ", ".join(row.instance for row in live)
    return True, f"{len(live)} bridge(s) hear the bus: {names}"


def delivery_check() -> tuple[dict, float | None]:
    """Whether the receivers answered what the broker took, second by second (shared by
    every bridge through the cache). A second is judged once REACH_ACK_TIMEOUT_MS has passed
    since it ended (the console's own deadline for an answer, so answers still in flight on a
    healthy console do not count against it), and the second in which every process hands
    its counts over."""
    threshold = settings.REACH_READY_MIN_DELIVERY_RATE
    at_least = settings.REACH_READY_MIN_TRANSMISSIONS
    settle_ms = settings.REACH_ACK_TIMEOUT_MS + int(FLUSH_EVERY_S * 1000)
    check: dict = {"ok": True, "threshold": threshold, "minTransmissions": at_least,
                   "judgedAfterMs": settle_ms}
    try:
        rate: DeliveryRate = delivery_rate(settle_s=settle_ms / 1000)
    except Exception as exc:  # the cache (Redis) is down: its own check says so
        check["detail"] = f"cannot tell (cache: {type(exc).__name__})"
        return check, None
    published = sum(p for _, p, _ in rate.seconds)
    answered = sum(min(a, p) for _, p, a in rate.seconds)
    check["published"], check["answered"] = published, answered
    judged = rate.lowest_of(at_least=at_least)
    if rate.lowest is None:
        check["detail"] = "no task request taken by the broker in the last 10 s"
    elif judged is not None and judged < threshold:
        check["ok"] = False
        check["detail"] = (f"receivers answered only {judged:.0%} of the task requests the broker "
                           f"took in one second (below {threshold:.0%}): messages are not "
                           "being delivered; is the broker dropping them, or are the nodes "
                           "down?")
    else:
        check["detail"] = (f"{answered} of {published} task requests answered in the last 10 s"
                           f" (lowest second {rate.lowest:.0%})")
    return check, rate.lowest


# name, check, and the earlier check whose source it reads (the bridges' hearing is read from
# the database): in that order.
_READY_CHECKS = (("database", _check_database, ""), ("redis", _check_redis, ""),
                 ("broker", broker_check, "database"))


@require_GET
@never_cache
def readyz(request: HttpRequest) -> JsonResponse:
    """200 when the console can deliver; 503 with the reasons when it cannot: the database
    or Redis is down, no bridge hears the bus (connected and subscribed, its writes commit),
    or the receivers stopped answering what the broker took (`deliveryRate.min10s`: the
    lowest share answered in any second of the last ten, null without traffic)."""
    started = time.monotonic()
    checks = {}
    for name, check, reads in _READY_CHECKS:
        if reads and not checks[reads]["ok"]:
            # Asking again would wait for it a second time (a stalled database: the pool's
            # timeout again), to learn nothing more.
            ok, detail = False, f"cannot tell (the {reads} does not answer)"
        else:
            ok, detail = check()
        checks[name] = {"ok": ok, "detail": detail}
    checks["delivery"], lowest = delivery_check()
    ready = all(item["ok"] for item in checks.values())
    body = {
        "status": "ready" if ready else "not ready",
        "checks": checks,
        "deliveryRate": {"min10s": None if lowest is None else round(lowest, 4)},
        "elapsedMs": round((time.monotonic() - started) * 1000, 1),
    }
    if not ready:
        body["reason"] = "; ".join(f"{name}: {item['detail']}" for name, item in checks.items()
                                   if not item["ok"])
    return JsonResponse(body, status=200 if ready else 503)


@require_GET
@never_cache
def metrics(request: HttpRequest) -> HttpResponse:
    """The whole console's metrics (reachconsole/collector.py), in the format the scraper
    asks for (Prometheus text by default, OpenMetrics on request)."""
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(registry), content_type=content_type)
