"""The database is the outbox: a send is a SENT row with `publish_at` set, nothing more.

Whoever makes rows due (a send, a sweep, a release of held work) calls `outbox_wake()` in the
same transaction; every bridge, in whatever process, claims due rows itself
(`outbox_claim`: `skip_locked`, guarded on SENT), publishes them and marks them PUBLISHED on
the PUBACK. No code needs to find "the process with the bridge", so any Celery pool works and
several bridges share the work. A bridge that dies after its claim leaves the rows to come
due again when the claim runs out (`REACH_OUTBOX_CLAIM_S`): a duplicate on the bus at worst,
which receivers absorb by idempotency key, never a lost message.

Waking: with Redis (production), a message on a Redis channel right after the commit; on
PostgreSQL without Redis, a `NOTIFY` inside the transaction (delivered only if it commits).
Redis comes first because PostgreSQL serializes the commits of every transaction that
notified (a database-wide lock at commit), and senders hold their agent's load row until
their commit. Bridges in this process are also woken after commit. A slow poll
(`REACH_OUTBOX_POLL_S`) covers everything else: a lost wake-up only costs latency.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, connections, transaction
from django.utils import timezone

from messages.models import Direction, Message, Status
from messages.protocol import MessageType

log = logging.getLogger(__name__)

CHANNEL = "reach_outbox"
_redis_client = None
_subscribers: list[Callable[[], None]] = []
_subscribers_lock = threading.Lock()


def outbox_wake() -> None:
    """Rows became due in the current transaction: wake the bridges once it commits."""
    if settings.REDIS_URL:
        transaction.on_commit(_wake_redis)
    elif connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            # Transactional: sent at commit, dropped on rollback, collapsed per transaction.
            cursor.execute(f"NOTIFY {CHANNEL}")
    transaction.on_commit(_wake_local)


def _redis_channel() -> str:
    # One channel per console database: consoles sharing a Redis server wake only their own.
    return f"{CHANNEL}:{settings.DATABASES['default']['NAME']}"


def _wake_redis() -> None:
    global _redis_client
    import redis

    try:
        if _redis_client is None:
            _redis_client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1.0,
                                                 socket_connect_timeout=1.0)
        _redis_client.publish(_redis_channel(), b"1")
    except redis.RedisError:
        pass  # Redis is down: the bridges' poll finds the rows


def _wake_local() -> None:
    with _subscribers_lock:
        callbacks = list(_subscribers)
    for callback in callbacks:
        callback()


def outbox_subscribe(callback: Callable[[], None]) -> None:
    with _subscribers_lock:
        _subscribers.append(callback)


def outbox_unsubscribe(callback: Callable[[], None]) -> None:
    with _subscribers_lock:
        if callback in _subscribers:
            _subscribers.remove(callback)


def outbox_claim(*, limit: int, now: datetime | None = None) -> list[Message]:
    """Claim up to `limit` due SENT rows for this bridge, oldest due first.

    Locks only message rows (skip_locked: two bridges take disjoint rows), and moves each
    claimed row's `publish_at` a claim's length ahead instead of clearing it, so a bridge
    that dies before the PUBACK leaves the row to be claimed again.
    """
    now = now or timezone.now()
    until = now + timedelta(seconds=settings.REACH_OUTBOX_CLAIM_S)
    with transaction.atomic():
        rows = list(
            Message.objects.select_for_update(skip_locked=True)
            .filter(status=Status.SENT, publish_at__lte=now)
            .order_by("publish_at", "id")[:limit]
        )
        if rows:
            claimed = Message.objects.filter(pk__in=[r.pk for r in rows], status=Status.SENT,
                                             publish_at__lte=now).update(publish_at=until)
            if claimed != len(rows):  # pragma: no cover - only if a row lock was not honoured
                log.warning("outbox claim changed %d of %d locked rows", claimed, len(rows))
    return rows


def outbox_defer(*, pks: list[int], until: datetime) -> None:
    """Rows a bridge claimed but could not hand to paho (its queue is full): due again at
    `until`, for any bridge. Backpressure, not a failure: they stay SENT."""
    if pks:
        Message.objects.filter(pk__in=pks, status=Status.SENT).update(publish_at=until)


def outbox_release_responses(*, request_ids: list[str], now: datetime) -> int:
    """Due now: the console agents' responses to these requests, which waited until the
    broker had taken the ACK before them (messages/inbound.py), so that whichever bridge
    publishes them, the requester hears the ACK first. Returns how many."""
    if not request_ids:
        return 0
    return Message.objects.filter(
        in_reply_to__in=request_ids, message_type=MessageType.TASK_RESPONSE,
        direction=Direction.SEND, status=Status.SENT,
        publish_at__isnull=True).update(publish_at=now)


class OutboxListener:
    """Listens for outbox_wake() in its own thread (Redis pub/sub, or PostgreSQL `LISTEN` on
    its own autocommit connection) and calls `wake` on every signal. Reconnects after an
    outage; the bridge's slow poll covers the gap."""

    def __init__(self, wake: Callable[[], None], *, alias: str = "default"):
        self.wake = wake
        self.alias = alias
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if settings.REDIS_URL:
            target = self._run_redis
        elif connections[self.alias].vendor == "postgresql":
            target = self._run
        else:
            return  # one process (SQLite): the in-process wake-up is all there is
        self._thread = threading.Thread(target=target, name="outbox-listen", daemon=True)
        self._thread.start()

    def _run_redis(self) -> None:
        import redis

        delay = 0.5
        while not self._stop.is_set():
            try:
                client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2.0,
                                              health_check_interval=10)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(_redis_channel())
                delay = 0.5
                self.wake()  # whatever came due while we were not listening
                while not self._stop.is_set():
                    if pubsub.get_message(timeout=1.0) is not None:
                        self.wake()
            except Exception as exc:  # Redis is down: retry, the poll still runs
                if self._stop.is_set():
                    return
                log.warning("outbox wake-up channel lost (%s); retrying in %.1f s", exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 10.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(7)
            self._thread = None

    def _run(self) -> None:
        import psycopg

        params = connections[self.alias].get_connection_params()
        params.pop("cursor_factory", None)
        delay = 0.5
        while not self._stop.is_set():
            try:
                with psycopg.connect(**params, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    delay = 0.5
                    self.wake()  # whatever came due while we were not listening
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=5.0):
                            self.wake()
                            break
            except Exception as exc:  # the database is down: retry, the poll still runs
                if self._stop.is_set():
                    return
                log.warning("outbox LISTEN connection lost (%s); retrying in %.1f s", exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 10.0)
