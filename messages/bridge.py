"""The MQTT bridge: the console's one paho-mqtt client, owned by one thread.

paho's network thread only hands work over (a bounded queue: when the console falls behind,
paho stops reading and the broker holds the messages). The owner thread does everything
else: it writes each batch of inbound messages in one transaction, acknowledges them to the
broker only after the commit (`manual_ack`), claims due rows from the outbox
(messages/outbox.py) and publishes them, marks them PUBLISHED on PUBACK, sends the console's
heartbeat, and sends the probe whose return proves, and reports, up to when it hears the bus
(roster/hearing.py). RELIABILITY.md lists the failures this is built around.
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
from datetime import UTC, datetime, timedelta
from typing import Any

import paho.mqtt.client as mqtt
import redis.exceptions
from django.conf import settings
from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
)
from django.utils import timezone
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from messages import protocol
from messages.broker_caps import REFRESH_S, SYS_WAIT_S, broker_caps_record, connack_caps
from messages.client_ids import client_id_for, legacy_sessions_end
from messages.handlers import (
    LOCAL_HANDLERS,
    console_agents_heartbeat,
    console_agents_register,
    console_agents_renew,
)
from messages.inbound import Incoming, IngestResult, messages_ingest
from messages.ingest_lock import Hold, IngestLock
from messages.models import Message
from messages.mqtt_client import (
    broker_target,
    connect_failure_reason,
    mqtt_client,
    refusal_reason,
)
from messages.outbox import (
    OutboxListener,
    outbox_claim,
    outbox_defer,
    outbox_subscribe,
    outbox_unsubscribe,
)
from messages.probes import Probe, ProbeChain, probe_decode
from messages.puback import Puback, pubacks_apply
from messages.rows import row_encode
from messages.subscriptions import BROKER_DROPPED_TOPIC, PLAIN_INBOX_SID, IngestPlan
from reachconsole.core import identity
from reachconsole.core.broker_drops import broker_drops_note
from reachconsole.core.logs import log_fields
from reachconsole.core.metrics import LocalCounter
from roster.hearing import PROBE_EVERY_S, hearing_lost, hearing_record

log = logging.getLogger(__name__)

QUEUE_LIMIT = 20_000
RETRY_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
LOCK_TRY_EVERY_S = 1.0  # single mode: how often a standby tries the lock, the holder checks it
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
    received_at: float = 0.0  # time.time() when paho handed it over
    copy: bool = False  # came through the plain own-inbox subscription (plan.plain_inbox)


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


def connection_keep() -> None:
    """Before database work in the owner thread: keep this thread's connection unless it
    failed.

    `close_old_connections()` hands the connection back to the pool on every call
    (CONN_MAX_AGE is 0, for request threads), and the pool checks it with a round trip when
    it is taken again: at 200 msg/s that check was about a sixth of the owner thread's time
    (bench/stream_latency.py under py-spy), on the path of every message to the pages. The
    owner is one long-lived thread, so it keeps its connection. After an error (the database
    restarted, the network dropped) the connection is let go as before, and the retry takes
    a fresh one."""
    if connection.errors_occurred:
        close_old_connections()


class Bridge:
    def __init__(self, *, url: str, node_id: str, prefix: str, instance: str = "1",
                 protocol_version: str = "5", monitor: bool = True,
                 session_expiry_s: int = 3600, max_queued: int = 10000, batch: int = 500,
                 heartbeat_ms: int = 5000, share_group: str = "", ingest: str = "auto",
                 console_id: str = "", keepalive_s: int = 15,
                 reconnect_delay_s: tuple[float, float] = (1, 30)):
        # TLS and credentials come with the URL and the settings (messages/mqtt_client.py).
        self.target = broker_target(url, protocol=protocol_version)
        self.url = self.target.display  # never the password: this one is logged
        self.node_id = node_id
        self.prefix = prefix
        self.instance = instance
        self.client_id = client_id_for(node_id, instance, console_id)
        self.keepalive_s = keepalive_s
        self.probe_topic = protocol.probe_topic(prefix, self.client_id)
        self._short_lives = 0  # connections in a row the broker closed within seconds
        self.v5 = protocol_version == "5"
        self.monitor = monitor
        self.session_expiry_s = session_expiry_s
        self.max_queued = max_queued
        self.batch = batch
        self.heartbeat_s = heartbeat_ms / 1000
        self.reconnect_delay_s = reconnect_delay_s  # paho's (least, largest) wait
        # What the broker can do, as its CONNACK and $SYS told us (messages/broker_caps.py).
        self.caps: dict[str, Any] = {}
        # One group per console (settings.REACH_BRIDGE_SHARE_GROUP): two consoles on one
        # broker must each get every message, their own bridges only a share of it.
        self.share_group = share_group or f"reach-{node_id or 'anon'}"
        self.plan = IngestPlan(prefix=prefix, node_id=node_id, monitor=monitor,
                               share_group=self.share_group, probe_topic=self.probe_topic,
                               setting=ingest, v5=self.v5, caps=self.caps)
        self._ingest_lock: IngestLock | None = None  # single mode only
        self._next_lock_try = 0.0
        self._outage_said = False  # single mode: the database-outage warning, once an outage
        self._subscribe_lock = threading.Lock()  # paho's thread and the owner both subscribe
        # (mid, filters) of the SUBSCRIBE whose SUBACK sets `listening`
        self._awaited_suback: tuple[int, list[str]] | None = None
        self.counts = LocalCounter()
        self.connected = threading.Event()
        # Connected AND subscribed to what this bridge must hear in its mode (shared: at once;
        # single: once it knows whether it holds the ingest lock): what wait_connected means.
        self.listening = threading.Event()
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
        # Renewed (by paho's thread) each time the broker grants what this bridge must hear:
        # only probes sent after that prove anything (messages/probes.py).
        self.probes = ProbeChain()
        self._last_probe = 0.0  # monotonic, when the owner last sent one
        self._last_db_warning = 0.0
        self._stop = threading.Event()
        self._owner: threading.Thread | None = None
        self._client: mqtt.Client | None = None
        self._last_heartbeat = 0.0
        self._last_flush = 0.0
        self._counted_generation = 0  # connections counted so far (reconnects metric)
        self.dropped_total: int | None = None
        self._connected_at = 0.0
        self._caps_refreshed = 0.0

    @classmethod
    def from_settings(cls) -> Bridge:
        return cls(
            url=settings.MQTT_URL, node_id=settings.REACH_NODE_ID,
            prefix=settings.MQTT_TOPIC_PREFIX, instance=settings.REACH_BRIDGE_INSTANCE,
            protocol_version=settings.MQTT_PROTOCOL, monitor=settings.REACH_MONITOR,
            session_expiry_s=settings.MQTT_SESSION_EXPIRY_S,
            max_queued=settings.MQTT_MAX_QUEUED, batch=settings.REACH_BRIDGE_BATCH,
            heartbeat_ms=settings.REACH_HEARTBEAT_MS,
            share_group=settings.REACH_BRIDGE_SHARE_GROUP or identity.console_id(),
            ingest=settings.REACH_BRIDGE_INGEST,
            keepalive_s=settings.MQTT_KEEPALIVE_S,
        )

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if not self.node_id:
            log.warning("REACH_NODE_ID is empty: the bridge stays out of targeted delivery "
                        "(no inbox subscription, no heartbeat); set REACH_NODE_ID")
        client = mqtt_client(target=self.target, client_id=self.client_id,
                             clean_session=False, manual_ack=True)
        client.max_queued_messages_set(self.max_queued)
        client.max_inflight_messages_set(100)
        least, largest = self.reconnect_delay_s
        client.reconnect_delay_set(min_delay=least, max_delay=largest)
        client.on_connect = self._guard(self._on_connect)
        client.on_connect_fail = self._guard(self._on_connect_fail)
        client.on_disconnect = self._guard(self._on_disconnect)
        client.on_message = self._guard(self._on_message)
        client.on_publish = self._guard(self._on_publish)
        client.on_subscribe = self._guard(self._on_subscribe)
        self._client = client
        # Used only if the broker cannot share subscriptions (decided on each CONNACK).
        self._ingest_lock = IngestLock(name=self.share_group)
        self._register_local_agents()
        threading.Thread(target=legacy_sessions_end, name="mqtt-legacy-session", daemon=True,
                         kwargs={"target": self.target, "node_id": self.node_id,
                                 "instance": self.instance, "current": self.client_id}).start()
        if self.v5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.session_expiry_s
            client.connect_async(self.target.host, self.target.port, keepalive=self.keepalive_s,
                                 clean_start=False, properties=props)
        else:
            client.connect_async(self.target.host, self.target.port, keepalive=self.keepalive_s)
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
        if self._ingest_lock is not None:
            self._ingest_lock.release()  # a standby takes over at once, not after a timeout
        if self._client is not None:
            self._client.disconnect()
            self._client.loop_stop()
            self._client = None
        if self.caps:
            self._caps_record(connected=False)  # the pages stop counting on this one
        self.counts.flush()

    def wait_connected(self, timeout: float = 10.0) -> bool:
        """Connected and subscribed for its ingest mode (see `listening`)."""
        return self.listening.wait(timeout)

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

    # --- subscriptions (what they are: messages/subscriptions.py) ---------------------------
    def _sync_subscriptions(self, client: mqtt.Client | None, *, then_listen: bool = False
                            ) -> None:
        """Subscribe to what this bridge must hear, then drop the rest: in that order, an
        overlap delivers a message twice (the insert is idempotent), a gap would lose it.
        `then_listen`: set `listening` once the broker has granted these subscriptions
        (their SUBACK), not when they are asked for: a message published in between
        matches nothing on the broker, and is gone."""
        if client is None:
            return
        plan = self.plan
        with self._subscribe_lock:
            plain = plan.plain_inbox()
            if plain:
                # Its own SUBSCRIBE: an identifier is given per packet. Granted before the
                # rest (the broker answers in order), so `listening` covers it too.
                props = Properties(PacketTypes.SUBSCRIBE)
                props.SubscriptionIdentifier = PLAIN_INBOX_SID
                client.subscribe(plain, qos=1, properties=props)
            subscriptions = plan.subscriptions()
            _, mid = client.subscribe(subscriptions)
            if then_listen:
                self._awaited_suback = (mid, [topic for topic, _ in subscriptions])
            stale = plan.stale_filters()
            if stale:
                client.unsubscribe(stale)

    def _ingest_mode_decide(self) -> None:
        """Decide the ingest mode (messages/subscriptions.py); say which in the log whenever
        it changes (once per bridge, not per reconnect)."""
        lock = self._ingest_lock
        why = self.plan.decide(lock_held=lock is not None and lock.held)
        if not why:
            return
        if self.plan.mode == "shared":
            log.info("MQTT ingest: shared, bridge %s takes a share of group %r (%s)",
                     self.client_id, self.share_group, why)
            return
        # A warning where it limits scaling out; the embedded mode has one process anyway.
        level = logging.WARNING if lock is not None and lock.vendor == "postgresql" else (
            logging.INFO)
        log.log(level, "MQTT ingest: one active bridge (%s); ingest lock: %s; bridge %s %s",
                why, lock.what if lock else "none", self.client_id,
                "ingests" if self.plan.ingesting else
                "waits for the lock and publishes the outbox meanwhile")

    @property
    def ingest_mode(self) -> str:
        """"shared" or "single", decided on each CONNACK ("" before the first)."""
        return self.plan.mode

    def _ingest_lock_turn(self, now: float) -> None:
        """Single mode (owner thread): take the ingest lock, or check the one held, about
        once a second, and (un)subscribe when that changes. A bridge that lost the broker
        lets the lock go, so a connected one ingests meanwhile."""
        lock, plan = self._ingest_lock, self.plan
        if plan.mode != "single" or lock is None or now < self._next_lock_try:
            return
        self._next_lock_try = now + LOCK_TRY_EVERY_S
        if not self.connected.is_set():
            self.listening.clear()
            if lock.held and lock.vendor == "postgresql":
                lock.release()
                plan.ingesting = False
                log.warning("bridge %s lost the broker: released the ingest lock",
                            self.client_id)
            return
        hold = lock.hold()
        if hold is Hold.UNKNOWN:
            # The database is away: nobody stores anything now, and nobody can be known to
            # hold the lock. Standing by would unsubscribe, and what the other nodes publish
            # meanwhile would match no subscriber and be gone (observed traffic at every
            # PostgreSQL restart). Subscribed, this bridge leaves it unacknowledged with the
            # broker until it can store it; the first answer from the database decides (and
            # a bridge that finds the lock taken then stands by, its duplicates idempotent).
            if not self._outage_said:
                self._outage_said = True
                log.warning("bridge %s cannot ask for the ingest lock (%s): it stays "
                            "subscribed until the database answers", self.client_id,
                            lock.unreachable)
            return
        self._outage_said = False
        held = hold is Hold.HELD
        first = not plan.lock_asked
        plan.lock_asked = True
        if held == plan.ingesting and not first:
            return
        if held == plan.ingesting:  # the first answer since connecting, and no change
            self._sync_subscriptions(self._client, then_listen=True)
            return
        plan.ingesting = held
        self.probes.restart()  # what it hears changes
        self.listening.clear()
        if held:
            # It says it hears the bus on the next turn after the SUBACK (_on_subscribe), not
            # up to a second later: readiness and /metrics should not lag the ingest.
            log.warning("bridge %s took the ingest lock: it ingests now", self.client_id)
        else:
            log.warning("bridge %s lost the ingest lock: standby (publishes the outbox only)",
                        self.client_id)
        self._sync_subscriptions(self._client, then_listen=True)

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            # Logged once per reason (broker_caps), not on every reconnect attempt.
            self._caps_record(connected=False, error=refusal_reason(reason_code, self.target))
            return
        self._caps_connected(properties)
        self.generation += 1
        # Subscribe every time, whatever session_present says: a broker that lost the
        # session (restart without persistence) must not leave the console deaf.
        try:
            # paho leaves Nagle's algorithm on: our small PUBACKs and the next publish then
            # wait ~40 ms for a delayed TCP ACK, on every hop of every slot cycle.
            client.socket().setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (AttributeError, OSError) as exc:
            log.warning("could not set TCP_NODELAY on the MQTT socket: %s", exc)
        self.plan.lock_asked = False
        self._next_lock_try = 0.0  # single mode: ask for the lock on the next step
        self._ingest_mode_decide()
        # Single mode listens once the ingest lock has been asked (_ingest_lock_turn).
        self._sync_subscriptions(client, then_listen=(self.plan.mode == "shared"
                                                      or self._ingest_lock is None))
        self.connected.set()
        self._wake_outbox()  # what came due while we were away
        log.info("MQTT bridge connected (session present: %s)", flags.session_present)

    def _on_connect_fail(self, client, userdata) -> None:
        # paho's reconnect loop swallowed the reason (TLS, DNS, refused): find it out, so the
        # log says it once and readiness can say it, rather than "connection failed" forever.
        self._caps_record(connected=False,
                          error=connect_failure_reason(self.target)
                          or f"the broker {self.url} closed the connection during CONNECT")

    def _caps_record(self, **facts: Any) -> None:
        self.caps.update(facts)
        broker_caps_record(instance=self.client_id, url=self.url,
                           protocol=self.target.protocol, **facts)

    def _caps_connected(self, properties) -> None:
        """A CONNACK that accepted us: what it says the broker can do. Whether `$SYS` drop
        counters come is known later (step → _caps_tick)."""
        self._connected_at = time.monotonic()
        self._caps_record(connected=True, error="",
                          **connack_caps(v5=self.v5, properties=properties,
                                         requested_expiry_s=self.session_expiry_s))

    def _caps_tick(self, now: float) -> None:
        """Owner thread: decide that `$SYS` counters do not come, and keep the entry fresh."""
        if (self.connected.is_set() and self.caps.get("sys_drops") is None
                and now - self._connected_at >= SYS_WAIT_S):
            self._caps_record(sys_drops=False)
        elif now - self._caps_refreshed >= REFRESH_S and self.caps:
            self._caps_refreshed = now
            self._caps_record()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        """A broker may advertise shared subscriptions and still refuse one (reason 0x9E),
        or refuse a filter for other reasons (ACLs): said in the log, and a refused share
        turns this bridge to single mode instead of leaving it deaf."""
        with self._subscribe_lock:
            awaited = self._awaited_suback
            if awaited is not None and awaited[0] == mid:
                self._awaited_suback = None
                deaf = [topic for topic, rc in zip(awaited[1], reason_codes, strict=False)
                        if getattr(rc, "is_failure", False) and topic != BROKER_DROPPED_TOPIC]
                if not deaf:  # (refused inbound filters are logged below)
                    self.probes.renew()  # a new chain from here
                    self.listening.set()
                    self._last_hearing = 0.0  # say so on the owner's next turn
        refused = [rc for rc in reason_codes if getattr(rc, "is_failure", False)]
        if not refused:
            return
        log.error("MQTT broker refused %d of the bridge's subscriptions: %s", len(refused),
                  ", ".join(sorted({str(rc) for rc in refused})))
        if (any(rc.value == 0x9E for rc in refused) and self.plan.mode == "shared"
                and self.plan.setting == "auto"):
            self.plan.shares_refused = True
            self._ingest_mode_decide()
            self._sync_subscriptions(client, then_listen=True)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        was_connected = self.connected.is_set()
        self.connected.clear()
        self.listening.clear()
        self.probes.forget()
        # Closed within seconds of every CONNACK: what a broker does to the older of two
        # clients with one id, saying why only in MQTT 5 (142) and not always then.
        lasted = time.monotonic() - self._connected_at if was_connected else None
        self._short_lives = self._short_lives + 1 if lasted is not None and lasted < 5 else 0
        if reason_code == 142 or self._short_lives == 3:  # 142: MQTT 5 "session taken over"
            log.error("another client with this id took over the MQTT session %s%s: two "
                      "consoles (or two bridges) share REACH_CONSOLE_ID, REACH_NODE_ID and "
                      "REACH_BRIDGE_INSTANCE; give each bridge its own", self.client_id,
                      "" if reason_code == 142 else
                      " (the broker closed it within seconds of each of its last 3 connects)")
        if reason_code != 142 and not self._stop.is_set() and was_connected:
            # Only a lost connection: a refused CONNECT was said (once) by _on_connect.
            log.warning("MQTT bridge disconnected (%s); paho reconnects", reason_code)
            self._caps_record(connected=False)

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        if message.topic == BROKER_DROPPED_TOPIC:
            if not self.caps.get("sys_drops"):
                self._caps_record(sys_drops=True)
            self._broker_dropped(message.payload)
            return
        # Blocks when the owner is behind: paho stops reading and the broker keeps the rest.
        if message.topic == self.probe_topic:
            probe = probe_decode(message.payload)
            if probe is not None:
                self.probes.noted_back()
                # In line with what was received before it: it proves those are stored.
                self._work.put(probe)
            else:
                self.counts["probe_malformed"] += 1
            return
        ids = getattr(message.properties, "SubscriptionIdentifier", None) or ()
        copy = PLAIN_INBOX_SID in ids and bool(self.plan.plain_inbox())
        self._work.put(_Received(message.topic, message.payload, message.mid, message.qos,
                                 self.generation, time.time(), copy))

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
            broker_drops_note(dropped=total - previous, total=total, now=timezone.now())

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
            pass  # its proof stops growing by itself (roster/hearing.py)
        connection.close()  # this thread's own connection

    def step(self, wait: float = 0.0) -> bool:
        """One turn of the owner loop; returns whether it found work."""
        items = self._take(wait)
        received = [i for i in items if isinstance(i, _Received)]
        probes = [i for i in items if isinstance(i, Probe)]
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
        if probes:
            self.probes.back(probes)  # after the ingest: what came before them is stored
        now = time.monotonic()
        found = bool(items)
        self._guard_db(lambda: self._ingest_lock_turn(now))
        if self.connected.is_set() and (self._outbox_due.is_set() or now >= self._next_poll):
            self._outbox_due.clear()
            self._next_poll = now + settings.REACH_OUTBOX_POLL_S
            found = self._guard_db(self._publish_due) or found
        if self.connected.is_set() and now - self._last_probe >= PROBE_EVERY_S:
            self._last_probe = now
            self._probe_send(now)
        if now - self._last_hearing >= HEARING_EVERY_S:
            self._last_hearing = now
            self._guard_db(self._report_hearing)
            self._caps_tick(now)
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
            connection_keep()
            return bool(work())
        except INFRA_DOWN as exc:
            now = time.monotonic()
            if now - self._last_db_warning >= 10:
                self._last_db_warning = now
                log.warning("bridge cannot reach the database (%s); retrying", exc)
            return False

    # --- hearing: the probe ---------------------------------------------------------------------
    def _probe_send(self, now: float) -> None:
        """Owner thread: send the next probe, and call the connection dead when one sent a
        keepalive ago has still not come back (a connection that stalls without closing:
        paho alone would wait up to two keepalives, and the broker 1.5). Not while the owner
        is behind (paho then stops reading, probes included), and not for time it spent away
        (a database outage): only a probe that was sent and never answered counts."""
        client = self._client
        if client is None or not self.probes.nonce:
            return
        waited = self.probes.unanswered_for(now, connected_at=self._connected_at)
        if waited >= self.keepalive_s and self._work.qsize() < self.batch:
            self._connection_dead(client, waited)
            return
        client.publish(self.probe_topic, self.probes.send(), qos=0)

    def _connection_dead(self, client: mqtt.Client, waited: float) -> None:
        self.counts["probe_timeouts"] += 1
        log.error("no probe came back through the MQTT broker for %.0f s (MQTT_KEEPALIVE_S=%d):"
                  " the connection is dead though open; reconnecting", waited, self.keepalive_s)
        self.probes.broken(time.monotonic())  # the next SUBACK starts the next chain
        sock = client.socket()
        if isinstance(sock, socket.socket):
            try:
                # paho's network thread sees the connection end and reconnects as after any
                # loss; a disconnect() would wait on the dead socket. The plain socket's
                # shutdown, even under TLS: SSLSocket.shutdown unwraps the TLS layer under
                # paho's reading thread instead of letting it see the end of the stream.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def _report_hearing(self) -> None:
        """Whether the console hears the bus decides whether leases may run out, and up to
        when it may judge anyone's silence (roster/hearing.py): the chain of probes back.
        A standby (single mode, without the ingest lock) hears nothing of the bus: if it
        reported, leases could run out while nobody ingests their heartbeats."""
        heard = self.probes.heard
        if (self.connected.is_set() and self.plan.ingesting and self.listening.is_set()
                and heard is not None):
            hearing_record(instance=self.client_id, since=heard[0], through=heard[1])
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
        # One message through both of our subscriptions to the own inbox (plain and shared)
        # comes twice, usually in one batch: the shared copy is kept, the plain one is
        # dropped. Every copy is still acknowledged after the commit.
        kept: dict[tuple[str, bytes], Incoming] = {}
        for r in received:
            key = (r.topic, r.payload)
            if key not in kept or (kept[key].copy and not r.copy):
                kept[key] = Incoming(r.topic, r.payload,
                                     datetime.fromtimestamp(r.received_at, tz=UTC), copy=r.copy)
        batch = list(kept.values())
        attempt = 0
        while True:
            try:
                connection_keep()
                try:
                    result = messages_ingest(batch=batch, node_id=self.node_id,
                                             prefix=self.prefix, receiver=self.client_id)
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

    def _ingest_one_by_one(self, batch: list[Incoming]) -> IngestResult:
        total = IngestResult()
        for item in batch:
            try:
                one = messages_ingest(batch=[item], node_id=self.node_id, prefix=self.prefix,
                                      receiver=self.client_id)
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
        failed: list[Puback] = []
        deferred: list[int] = []
        released: list[str] = []
        now = timezone.now()
        for row in rows:
            try:
                data = row_encode(row)
            except (ValueError, TypeError) as exc:
                failed.append(Puback(pk=row.pk, request=False, at=now,
                                     not_sent=str(exc) or type(exc).__name__))
                released += filter(None, [_response_waits_for(row)])
                continue
            topic = row.topic or protocol.inbox_topic(self.prefix, row.target_node_id)
            info = client.publish(topic, data, qos=1)
            if info.rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                # NO_CONN: paho keeps a QoS 1 message and sends it on reconnect.
                request = row.message_type == protocol.MessageType.TASK_REQUEST
                self._pending[info.mid] = (row.pk, request, _response_waits_for(row))
                self.counts["published"] += 1
            else:
                # QUEUE_SIZE and friends: not queued. The row stays SENT, due again shortly.
                self.counts[f"publish_deferred:{mqtt.error_string(info.rc)}"] += 1
                deferred.append(row.pk)
        if deferred:
            jitter = 0.5 + random.random() * 0.5  # noqa: S311
            outbox_defer(pks=deferred, until=timezone.now() + timedelta(seconds=jitter))
        if failed:
            self._pubacks_apply(failed, release=released)

    def _confirm(self, confirms: list[_Confirmed]) -> None:
        pubacks: list[Puback] = []
        released: list[str] = []
        for item in confirms:
            pk, request, waiting = self._pending.pop(item.mid, (None, False, ""))
            if pk is None:
                continue
            if waiting:  # the broker has the ACK (or refused it): the response may go now
                released.append(waiting)
            pubacks.append(Puback(pk=pk, request=request, at=item.at,
                                  broker_refused=item.failure))
        self._pubacks_apply(pubacks, release=released)

    def _pubacks_apply(self, pubacks: list[Puback], *, release: list[str]) -> None:
        """Record what the broker said (messages/puback.py), retrying through a database
        outage."""
        if not pubacks:
            return
        for delay in (*RETRY_BACKOFF_S, None):
            try:
                connection_keep()
                result = pubacks_apply(pubacks=pubacks, release=release, now=timezone.now())
                if result.released:  # committed: the claim loop will see them
                    self._outbox_due.set()
                return
            except DatabaseError as exc:
                if delay is None or self._stop.is_set():
                    # Rows stay SENT: their claim runs out and they are published again.
                    log.error("could not record %d answers of the broker: %s",
                              len(pubacks), exc)
                    return
                time.sleep(delay)

    def _register_local_agents(self) -> None:
        if not self.node_id:
            return
        try:
            console_agents_register(node_id=self.node_id)
        except Exception:
            log.exception("could not register the console's own agents")

    def _heartbeat(self) -> None:
        heartbeat_ms = int(self.heartbeat_s * 1000)
        if self._client is not None:
            self._client.publish(protocol.heartbeat_topic(self.prefix, self.node_id),
                                 console_agents_heartbeat(node_id=self.node_id,
                                                          heartbeat_ms=heartbeat_ms), qos=0)
        try:
            connection_keep()
            console_agents_renew(node_id=self.node_id, heartbeat_ms=heartbeat_ms)
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
