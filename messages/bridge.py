"""The MQTT bridge: the console's one paho-mqtt client, owned by one thread.

paho's network thread only hands work over (a bounded queue: when the console falls behind,
paho stops reading and the broker holds the messages). The owner thread does everything
else: it writes each batch of inbound messages in one transaction, acknowledges them to the
broker only after the commit (`manual_ack`), claims due rows from the outbox
(messages/outbox.py) and publishes them, marks them PUBLISHED on PUBACK, sends the console's
heartbeat, and reports that it hears the bus (roster/hearing.py). RELIABILITY.md lists the
failures this is built around.
"""

from __future__ import annotations

import collections
import logging
import queue
import random
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
import redis.exceptions
from django.conf import settings
from django.core.cache import cache
from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
    transaction,
)
from django.utils import timezone
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from directory.resolver import LOCAL_AGENTS
from messages import protocol
from messages.delivery import ack_deadline
from messages.events import events_on_commit
from messages.handlers import LOCAL_HANDLERS
from messages.inbound import Incoming, messages_ingest
from messages.models import Message, Status
from messages.outbox import (
    OutboxListener,
    outbox_claim,
    outbox_defer,
    outbox_release_responses,
    outbox_subscribe,
    outbox_unsubscribe,
)
from messages.rows import envelope_from_row
from messages.state import Change, changes_apply
from reachconsole.core.logs import log_fields
from reachconsole.core.metrics import LocalCounter
from roster.hearing import hearing_lost, hearing_record
from roster.services import agent_register, heartbeat_record

log = logging.getLogger(__name__)

QUEUE_LIMIT = 20_000
BROKER_DROPPED_TOPIC = "$SYS/broker/publish/messages/dropped"
BROKER_DROPS_KEY = "broker-drops"
BROKER_DROPS_ALARM_S = 3600  # how long the pages show the alarm after the last drop
RETRY_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
# The database or the cache (Redis: the idempotency window) is down: wait, don't skip.
INFRA_DOWN = (OperationalError, InterfaceError, redis.exceptions.ConnectionError,
              redis.exceptions.TimeoutError)


@dataclass(frozen=True, slots=True)
class _Received:
    topic: str
    payload: bytes
    mid: int
    qos: int
    generation: int


_WAKE = object()  # wakes the owner thread: confirms are waiting, or the outbox has work
HEARING_EVERY_S = 1.0


@dataclass(frozen=True, slots=True)
class _Confirmed:
    mid: int
    failure: str  # "" when the broker took it
    at: datetime  # when the PUBACK arrived: published_at, and the receiver's clock starts


def _response_waits_for(row: Message) -> str:
    """The request whose response waits for this row to be published: an ACK by one of the
    console's own agents (messages/inbound.py holds their responses back), else ""."""
    if row.message_type == protocol.MessageType.ACK and row.from_agent_id in LOCAL_HANDLERS:
        return row.in_reply_to
    return ""


def _log_fields_of(payload: bytes) -> dict[str, str]:
    """The message's ids for a log line about a payload that failed after decoding."""
    env = protocol.decode(payload, max_bytes=settings.REACH_MAX_MESSAGE_BYTES)
    if isinstance(env, protocol.Rejection):
        return {}
    return log_fields(message_id=env.message_id, task_id=env.task_id or "",
                      agent=env.to_agent_id or "", node=env.target_node_id or "")


def client_id_for(node_id: str, instance: str) -> str:
    """One fixed id per bridge instance: a persistent session, and two bridges with one id
    would kick each other off the broker forever."""
    return f"reach-{node_id or 'anon'}-{instance}"[:64]


class Bridge:
    def __init__(self, *, url: str, node_id: str, prefix: str, instance: str = "1",
                 protocol_version: str = "5", monitor: bool = True,
                 session_expiry_s: int = 3600, max_queued: int = 10000, batch: int = 500,
                 heartbeat_ms: int = 5000):
        parsed = urlparse(url)
        if parsed.scheme not in {"mqtt", "mqtts", "tcp"} or not parsed.hostname:
            raise ValueError(f"MQTT URL {url!r}: use mqtt://host:port")
        self.url = url
        self.host = parsed.hostname
        self.port = parsed.port or (8883 if parsed.scheme == "mqtts" else 1883)
        self.tls = parsed.scheme == "mqtts"
        self.username, self.password = parsed.username, parsed.password
        self.node_id = node_id
        self.prefix = prefix
        self.client_id = client_id_for(node_id, instance)
        self.v5 = protocol_version == "5"
        self.monitor = monitor
        self.session_expiry_s = session_expiry_s
        self.max_queued = max_queued
        self.batch = batch
        self.heartbeat_s = heartbeat_ms / 1000
        self.counts = LocalCounter()
        self.connected = threading.Event()
        self.generation = 0
        self._work: queue.Queue = queue.Queue(maxsize=QUEUE_LIMIT)
        self._confirms: collections.deque[_Confirmed] = collections.deque()
        # paho mid → (a2a_message pk, whether it is a task request, the request whose
        # response waits for this ACK or ""), until the PUBACK
        self._pending: dict[int, tuple[int, bool, str]] = {}
        self._outbox_due = threading.Event()
        self._next_poll = 0.0
        self._listener = OutboxListener(self._wake_outbox)
        self._hearing = False
        self._last_hearing = 0.0
        self._last_db_warning = 0.0
        self._stop = threading.Event()
        self._owner: threading.Thread | None = None
        self._client: mqtt.Client | None = None
        self._last_heartbeat = 0.0
        self._last_flush = 0.0
        self._counted_generation = 0  # connections counted so far (reconnects metric)
        self.dropped_total: int | None = None

    @classmethod
    def from_settings(cls) -> Bridge:
        return cls(
            url=settings.MQTT_URL, node_id=settings.REACH_NODE_ID,
            prefix=settings.MQTT_TOPIC_PREFIX, instance=settings.REACH_BRIDGE_INSTANCE,
            protocol_version=settings.MQTT_PROTOCOL, monitor=settings.REACH_MONITOR,
            session_expiry_s=settings.MQTT_SESSION_EXPIRY_S,
            max_queued=settings.MQTT_MAX_QUEUED, batch=settings.REACH_BRIDGE_BATCH,
            heartbeat_ms=settings.REACH_HEARTBEAT_MS,
        )

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if not self.node_id:
            log.warning("REACH_NODE_ID is empty: the bridge stays out of targeted delivery "
                        "(no inbox subscription, no heartbeat); set REACH_NODE_ID")
        client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id,
            protocol=mqtt.MQTTv5 if self.v5 else mqtt.MQTTv311,
            clean_session=None if self.v5 else False, manual_ack=True,
        )
        client.max_queued_messages_set(self.max_queued)
        client.max_inflight_messages_set(100)
        client.reconnect_delay_set(min_delay=1, max_delay=30)
        if self.username:
            client.username_pw_set(self.username, self.password)
        if self.tls:
            client.tls_set()
        client.on_connect = self._guard(self._on_connect)
        client.on_disconnect = self._guard(self._on_disconnect)
        client.on_message = self._guard(self._on_message)
        client.on_publish = self._guard(self._on_publish)
        self._client = client
        self._register_local_agents()
        if self.v5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.session_expiry_s
            client.connect_async(self.host, self.port, keepalive=30, clean_start=False,
                                 properties=props)
        else:
            client.connect_async(self.host, self.port, keepalive=30)
        client.loop_start()
        outbox_subscribe(self._wake_outbox)
        self._listener.start()
        self._owner = threading.Thread(target=self._run, name="mqtt-bridge", daemon=True)
        self._owner.start()
        log.info("MQTT bridge %s → %s (monitor %s)", self.client_id, self.url,
                 "on" if self.monitor else "off")

    def stop(self, timeout: float = 10.0) -> None:
        outbox_unsubscribe(self._wake_outbox)
        self._stop.set()
        self._listener.stop()
        if self._owner is not None:
            self._owner.join(timeout)
            self._owner = None
        if self._client is not None:
            self._client.disconnect()
            self._client.loop_stop()
            self._client = None
        self.counts.flush()

    def wait_connected(self, timeout: float = 10.0) -> bool:
        return self.connected.wait(timeout)

    def _wake_outbox(self) -> None:
        """Rows came due (any thread; never blocks)."""
        self._outbox_due.set()
        try:
            self._work.put_nowait(_WAKE)
        except queue.Full:
            pass  # the owner is busy and looks at the outbox on its next turn anyway

    # --- paho callbacks (network thread): hand over, never block on the database ------------
    def _guard(self, callback):
        """An exception escaping a paho callback kills paho's network thread (reconnects
        and PUBACKs stop): count it, log it, keep the loop alive."""

        def guarded(*args: Any) -> None:
            try:
                callback(*args)
            except Exception:
                self.counts["callback_errors"] += 1
                log.exception("MQTT callback %s failed", callback.__name__)

        return guarded

    def _subscriptions(self) -> list[tuple[str, int]]:
        # Brokers that publish $SYS counters (Mosquitto) report their drops here.
        subs = [(protocol.heartbeat_wildcard(self.prefix), 0), (BROKER_DROPPED_TOPIC, 0)]
        if self.monitor:
            # The wildcard covers our own inbox too (its topic makes those RECV); a second,
            # overlapping subscription would have the broker deliver them twice.
            subs.append((protocol.inbox_wildcard(self.prefix), 1))
        elif self.node_id:
            subs.append((protocol.inbox_topic(self.prefix, self.node_id), 1))
        return subs

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("MQTT broker %s refused the bridge: %s", self.url, reason_code)
            return
        self.generation += 1
        # Subscribe every time, whatever session_present says: a broker that lost the
        # session (restart without persistence) must not leave the console deaf.
        try:
            # paho leaves Nagle's algorithm on: our small PUBACKs and the next publish then
            # wait ~40 ms for a delayed TCP ACK, on every hop of every slot cycle.
            client.socket().setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (AttributeError, OSError) as exc:
            log.warning("could not set TCP_NODELAY on the MQTT socket: %s", exc)
        client.subscribe(self._subscriptions())
        self.connected.set()
        self._wake_outbox()  # what came due while we were away
        log.info("MQTT bridge connected (session present: %s)", flags.session_present)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        if reason_code == 142:  # MQTT 5 "session taken over"
            log.error("another client took over the MQTT session %s: give each bridge its own "
                      "REACH_BRIDGE_INSTANCE", self.client_id)
        elif not self._stop.is_set():
            log.warning("MQTT bridge disconnected (%s); paho reconnects", reason_code)

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        if message.topic == BROKER_DROPPED_TOPIC:
            self._broker_dropped(message.payload)
            return
        # Blocks when the owner is behind: paho stops reading and the broker keeps the rest.
        self._work.put(_Received(message.topic, message.payload, message.mid, message.qos,
                                 self.generation))

    def _broker_dropped(self, payload: bytes) -> None:
        """Mosquitto's count of messages it dropped (queues full, clients too slow): the only
        place such losses show. An increase is logged as an alarm and kept for the pages."""
        try:
            total = int(payload.decode().strip())
        except (UnicodeDecodeError, ValueError):
            return
        previous, self.dropped_total = self.dropped_total, total
        if previous is not None and total > previous:
            self.counts["broker_dropped"] += total - previous
            log.error("the MQTT broker dropped %d messages (%d since it started): raise its "
                      "max_queued_messages / max_inflight_messages (docs/performance.md)",
                      total - previous, total)
            cache.set(BROKER_DROPS_KEY, {"dropped": total - previous, "total": total,
                                         "at": timezone.now().isoformat()},
                      timeout=BROKER_DROPS_ALARM_S)

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        # paho calls this holding its outgoing-message lock, which the owner thread needs to
        # publish: never block here. Confirms are few (at most the in-flight window).
        failure = str(reason_code) if getattr(reason_code, "is_failure", False) else ""
        self._confirms.append(_Confirmed(mid, failure, timezone.now()))
        try:
            self._work.put_nowait(_WAKE)
        except queue.Full:
            pass  # the owner is busy anyway and drains the confirms on its next turn

    # --- the owner thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step(wait=0.2)
            except Exception:
                self.counts["owner_errors"] += 1
                log.exception("MQTT bridge step failed; continuing")
                time.sleep(0.5)
        self._drain_on_stop()
        try:
            hearing_lost(instance=self.client_id)
        except DatabaseError:
            pass  # the row ages out by itself (roster.hearing.HEARING_GAP_S)
        connection.close()  # this thread's own connection

    def step(self, wait: float = 0.0) -> bool:
        """One turn of the owner loop; returns whether it found work."""
        items = self._take(wait)
        received = [i for i in items if isinstance(i, _Received)]
        # PUBACKs first: a receiver's answer cannot precede the broker taking the request,
        # and the record should not say so.
        confirms = self._drain_confirms()
        try:
            if confirms:
                self._confirm(confirms)
        finally:
            # Whatever happened to the confirms, what was received is stored (and only then
            # acknowledged): dropped here, it would not be redelivered on a live connection.
            if received:
                self._ingest(received)
        now = time.monotonic()
        found = bool(items)
        if self.connected.is_set() and (self._outbox_due.is_set() or now >= self._next_poll):
            self._outbox_due.clear()
            self._next_poll = now + settings.REACH_OUTBOX_POLL_S
            found = self._guard_db(self._publish_due) or found
        if now - self._last_hearing >= HEARING_EVERY_S:
            self._last_hearing = now
            self._guard_db(self._report_hearing)
        if self.node_id and now - self._last_heartbeat >= self.heartbeat_s:
            self._last_heartbeat = now
            self._heartbeat()
        if now - self._last_flush >= 1.0:
            self._last_flush = now
            self._count_reconnects()
            self.counts.flush()
        return found

    def _count_reconnects(self) -> None:
        # The generation is bumped by paho's thread alone; counted here, by the owner, so the
        # counter needs no lock. The first connection is not a reconnect.
        generation = self.generation
        if self._counted_generation and generation > self._counted_generation:
            self.counts[f"reconnects:{self.client_id}"] += generation - self._counted_generation
        self._counted_generation = generation

    def _guard_db(self, work) -> bool:
        """Database work of the owner loop that may meet an outage: warn (at most every
        10 s), let the next turn try again."""
        try:
            close_old_connections()
            return bool(work())
        except INFRA_DOWN as exc:
            now = time.monotonic()
            if now - self._last_db_warning >= 10:
                self._last_db_warning = now
                log.warning("bridge cannot reach the database (%s); retrying", exc)
            return False

    def _report_hearing(self) -> None:
        """Whether the console hears the bus decides whether leases may run out: connected,
        and this turn's writes commit (an outage of the database or the worker is a gap)."""
        if self.connected.is_set():
            hearing_record(instance=self.client_id)
            self._hearing = True
        elif self._hearing:
            hearing_lost(instance=self.client_id)
            self._hearing = False

    def _publish_due(self) -> bool:
        """Claim due outbox rows, as many as paho can still queue, and publish them."""
        room = min(settings.REACH_OUTBOX_BATCH, self.max_queued - len(self._pending))
        if room <= 0:
            return False
        rows = outbox_claim(limit=room)
        if len(rows) == room:
            self._outbox_due.set()  # there may be more
        self._publish(rows)
        return bool(rows)

    def _drain_confirms(self) -> list[_Confirmed]:
        confirms = []
        while self._confirms:
            confirms.append(self._confirms.popleft())
        return confirms

    def _take(self, wait: float) -> list:
        try:
            first = self._work.get(timeout=wait) if wait else self._work.get_nowait()
        except queue.Empty:
            return []
        items = [first]
        # Natural batching: take what has queued up meanwhile, up to one batch of messages.
        while len(items) < self.batch:
            try:
                items.append(self._work.get_nowait())
            except queue.Empty:
                break
        return items

    def _ingest(self, received: list[_Received]) -> None:
        batch = [Incoming(r.topic, r.payload) for r in received]
        attempt = 0
        while True:
            try:
                close_old_connections()
                try:
                    result = messages_ingest(batch=batch, node_id=self.node_id,
                                             prefix=self.prefix)
                except INFRA_DOWN:
                    raise
                except Exception:
                    log.exception("a batch of %d messages failed; isolating the bad ones",
                                  len(batch))
                    result = self._ingest_one_by_one(batch)
                break
            except INFRA_DOWN as exc:
                # Keep the batch and keep trying: unacknowledged, the broker holds the rest,
                # and paho stops reading once the hand-over queue is full. Giving up would
                # leave the messages unacknowledged on a live connection, never redelivered.
                if self._stop.is_set():
                    log.error("stopping with %d messages unstored; the broker keeps them",
                              len(batch))
                    return
                delay = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
                attempt += 1
                log.warning("database or cache unavailable (%s); retrying in %.1f s", exc, delay)
                self.counts["ingest_retries"] += 1
                time.sleep(delay)
        self.counts.update(result.counts)
        self.counts[f"ingested:{self.client_id}"] += result.counts["stored"]
        self._ack(received)
        if result.to_publish:
            self._outbox_due.set()  # answers and freed work: publish them on this turn

    def _ingest_one_by_one(self, batch: list[Incoming]):
        from messages.inbound import IngestResult

        total = IngestResult()
        for item in batch:
            try:
                one = messages_ingest(batch=[item], node_id=self.node_id, prefix=self.prefix)
            except INFRA_DOWN:
                raise
            except Exception:
                # A message that makes the handler fail is counted and skipped, not retried
                # forever: everything behind it would wait.
                log.exception("skipping a message on %s that the handler cannot take", item.topic,
                              extra=_log_fields_of(item.payload))
                total.counts["handler_errors"] += 1
                continue
            total.counts.update(one.counts)
            total.to_publish += one.to_publish
        return total

    def _ack(self, received: list[_Received]) -> None:
        client = self._client
        if client is None:
            return
        for r in received:
            # An id from an earlier connection may now name another message: leave those to
            # the broker's redelivery (the insert is idempotent).
            if r.qos > 0 and r.generation == self.generation:
                client.ack(r.mid, r.qos)

    def _publish(self, rows: list[Message]) -> None:
        client = self._client
        if client is None or not rows:
            return
        failed: list[Change] = []
        deferred: list[int] = []
        released: list[str] = []
        for row in rows:
            try:
                data = protocol.encode(envelope_from_row(row),
                                       max_bytes=settings.REACH_MAX_MESSAGE_BYTES)
            except (ValueError, TypeError) as exc:
                failed.append(Change(pk=row.pk, to=Status.FAILED,
                                     allowed=frozenset({Status.SENT}), actor="bridge",
                                     reason=str(exc), fields={"error": str(exc)}))
                released += filter(None, [_response_waits_for(row)])
                continue
            topic = row.topic or protocol.inbox_topic(self.prefix, row.target_node_id)
            info = client.publish(topic, data, qos=1)
            if info.rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                # NO_CONN: paho keeps a QoS 1 message and sends it on reconnect.
                self._pending[info.mid] = (row.pk, row.message_type == "TASK_REQUEST",
                                           _response_waits_for(row))
                self.counts["published"] += 1
            else:
                # QUEUE_SIZE and friends: not queued. The row stays SENT, due again shortly.
                self.counts[f"publish_deferred:{mqtt.error_string(info.rc)}"] += 1
                deferred.append(row.pk)
        if deferred:
            jitter = 0.5 + random.random() * 0.5  # noqa: S311
            outbox_defer(pks=deferred, until=timezone.now() + timedelta(seconds=jitter))
        if failed:
            self._apply(failed, release=released)

    def _confirm(self, confirms: list[_Confirmed]) -> None:
        now = timezone.now()
        changes = []
        released: list[str] = []
        for item in confirms:
            pk, request, waiting = self._pending.pop(item.mid, (None, False, ""))
            if pk is None:
                continue
            if waiting:  # the broker has the ACK (or refused it): the response may go now
                released.append(waiting)
            if item.failure:
                reason = f"the broker refused it: {item.failure}"
                changes.append(Change(pk=pk, to=Status.FAILED, allowed=frozenset({Status.SENT}),
                                      actor="bridge", reason=reason,
                                      fields={"error": reason, "finished_at": now}))
            else:
                # The receiver's time to acknowledge runs from when the broker took it. An
                # answer of ours is done once the broker has it: it leaves the deadlines.
                fields = ({"published_at": item.at, "publish_at": None,
                           "ack_deadline_at": ack_deadline(item.at)} if request else
                          {"published_at": item.at, "publish_at": None, "deadline_at": None})
                changes.append(Change(pk=pk, to=Status.PUBLISHED,
                                      allowed=frozenset({Status.SENT}), actor="bridge",
                                      reason="PUBACK", fields=fields))
        skipped = self._apply(changes, now=now, release=released)
        # An ACK may have overtaken the PUBACK: keep the time the broker took it anyway.
        taken = [c.pk for c in changes if c.to == Status.PUBLISHED]
        if taken and skipped:
            try:
                Message.objects.filter(pk__in=taken, published_at__isnull=True).update(
                    published_at=now)
            except DatabaseError as exc:
                log.warning("could not record when the broker took %d messages: %s",
                            len(taken), exc)

    def _apply(self, changes: list[Change], now: datetime | None = None,
               release: list[str] | None = None) -> int:
        """Apply status changes, and make due the responses that waited for these ACKs
        (`release`: the requests they answer), retrying through a database outage; returns
        how many changes were skipped (their rows had moved on)."""
        if not changes:
            return 0
        now = now or timezone.now()
        for delay in (*RETRY_BACKOFF_S, None):
            try:
                close_old_connections()
                with transaction.atomic():
                    # With the ACK's change: a response is never left waiting for an ACK
                    # whose PUBACK was recorded. Before changes_apply, which may take agents'
                    # load rows: message rows first (messages/load.py, the lock order).
                    released = bool(release) and outbox_release_responses(request_ids=release,
                                                                          now=now)
                    applied = changes_apply(changes, now=now)
                    events_on_commit(applied.events)
                if released:  # committed: the claim loop will see them
                    self._outbox_due.set()
                return applied.skipped
            except DatabaseError as exc:
                if delay is None or self._stop.is_set():
                    # Rows stay SENT: their claim runs out and they are published again.
                    log.error("could not record %d status changes: %s", len(changes), exc)
                    return 0
                time.sleep(delay)
        return 0

    def _register_local_agents(self) -> None:
        if not self.node_id:
            return
        try:
            for agent_id in LOCAL_AGENTS:
                agent_register(agent_id=agent_id, node_id=self.node_id, version="console",
                               actor="bridge", metadata={"local": True})
        except Exception:
            log.exception("could not register the console's own agents")

    def _heartbeat(self) -> None:
        agents = [{"agentId": a, "inflight": 0, "queueDepth": 0, "maxInflight": 64}
                  for a in LOCAL_AGENTS]
        env = protocol.new_envelope(
            message_type=protocol.MessageType.HEARTBEAT, from_agent_id=self.node_id,
            headers={"originNodeId": self.node_id},
            payload={"heartbeatMs": int(self.heartbeat_s * 1000), "agents": agents},
        )
        if self._client is not None:
            self._client.publish(protocol.heartbeat_topic(self.prefix, self.node_id),
                                 protocol.encode(env), qos=0)
        try:
            close_old_connections()
            # Our own heartbeat comes back as an echo and is dropped: renew directly.
            heartbeat_record(node_id=self.node_id, agents=agents,
                             heartbeat_ms=int(self.heartbeat_s * 1000))
        except DatabaseError as exc:
            log.warning("could not renew the console's own agents: %s", exc)

    def _drain_on_stop(self) -> None:
        """Finish what was received (so it can be acknowledged) before the client closes."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            items = self._take(0)
            if not items:
                break
            received = [i for i in items if isinstance(i, _Received)]
            if received:
                self._ingest(received)
            confirms = self._drain_confirms()
            if confirms:
                self._confirm(confirms)

    def stats(self) -> dict[str, Any]:
        return {"connected": self.connected.is_set(), "queued": self._work.qsize(),
                "pending_pubacks": len(self._pending),
                "counts": dict(self.counts)}
