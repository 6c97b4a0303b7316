"""The bridge's MQTT session: one paho-mqtt client, its connection and what it subscribes to.

Everything here runs in paho's network thread or answers the owner thread's questions about
the connection; nothing here touches the database but the ingest lock and the broker's
capabilities record. What paho receives is handed over, never handled: messages and probes
go into one bounded queue (when the owner falls behind, paho stops reading and the broker
holds the rest), the broker's PUBACKs into a list of confirms. The owner loop
(messages/bridge.py) takes them, stores, acknowledges, publishes and confirms.

What the session keeps:
- the connection: connect with a persistent session, reconnect (paho's own loop), and call
  an open connection dead when the bridge's own probe stops coming back (`probe_send`);
- the subscriptions of the bridge's ingest mode (messages/subscriptions.py): shared with the
  console's other bridges, or one bridge holding the ingest lock (messages/ingest_lock.py);
- what the broker can do (messages/broker_caps.py), from its CONNACK and `$SYS`.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import paho.mqtt.client as mqtt
from django.utils import timezone
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from messages import protocol
from messages.broker_caps import REFRESH_S, SYS_WAIT_S, broker_caps_record, connack_caps
from messages.client_ids import client_id_for, legacy_sessions_end
from messages.ingest_lock import Hold, IngestLock
from messages.mqtt_client import (
    broker_target,
    connect_failure_reason,
    mqtt_client,
    refusal_reason,
)
from messages.probes import Probe, ProbeChain, probe_decode
from messages.subscriptions import BROKER_DROPPED_TOPIC, PLAIN_INBOX_SID, IngestPlan
from reachconsole.core.broker_drops import broker_drops_note
from reachconsole.core.metrics import LocalCounter

log = logging.getLogger(__name__)

QUEUE_LIMIT = 20_000
LOCK_TRY_EVERY_S = 1.0  # single mode: how often a standby tries the lock, the holder checks it


@dataclass(frozen=True, slots=True)
class Received:
    """A message as paho handed it over, to be stored and then acknowledged."""
    topic: str
    payload: bytes
    mid: int
    qos: int
    generation: int  # the connection it came on: its mid means nothing on another
    received_at: float = 0.0  # time.time() when paho handed it over
    copy: bool = False  # came through the plain own-inbox subscription (plan.plain_inbox)
    # The A2A-over-MQTT profile's messages only (roster/profile.py,
    # messages/profile_traffic.py): the retain flag, the user properties as (name, value)
    # pairs, the MQTT 5 Response Topic and Correlation Data.
    retain: bool = False
    user: tuple[tuple[str, str], ...] = ()
    response_topic: str = ""
    correlation: bytes = b""


@dataclass(frozen=True, slots=True)
class Confirmed:
    """The broker's PUBACK for one of our publishes."""
    mid: int
    failure: str  # "" when the broker took it
    at: datetime  # when the PUBACK arrived: published_at, and the receiver's clock starts


class Handoff:
    """paho's thread → the owner thread: received messages and probes in one queue, in the
    order they came (a probe proves what came before it), and the PUBACKs beside it.

    A deque and two events rather than a queue.Queue: its put (two locks and a notify per
    message) was a fifth of paho's thread in a burst. Appending is atomic; the owner is
    woken only when it may be waiting (`_ready` clear), and paho waits only at the limit."""

    def __init__(self, limit: int = QUEUE_LIMIT) -> None:
        self._items: collections.deque[Received | Probe] = collections.deque()
        self._limit = limit
        self._ready = threading.Event()  # items (or confirms, or outbox work) may be waiting
        self._room = threading.Event()  # fewer than `limit` items wait
        self._room.set()
        self._confirms: collections.deque[Confirmed] = collections.deque()

    def put(self, item: Received | Probe) -> None:
        """Blocks while `limit` items wait: paho stops reading and the broker keeps the
        rest."""
        items = self._items
        while len(items) >= self._limit:
            self._room.clear()
            if len(items) >= self._limit:  # the owner may have taken some since the check
                self._room.wait(0.5)
        items.append(item)
        # After the append: an owner that cleared `_ready` before it took finds the item
        # then, or sees `_ready` set again.
        if not self._ready.is_set():
            self._ready.set()

    def confirm(self, confirmed: Confirmed) -> None:
        """Never blocks: paho calls on_publish holding the lock the owner needs to publish."""
        self._confirms.append(confirmed)
        self.wake()

    def wake(self) -> None:
        """Any thread, never blocks: the owner's next turn starts now."""
        if not self._ready.is_set():
            self._ready.set()

    def take(self, wait: float, limit: int) -> list[Received | Probe]:
        """What has come, at most `limit` items (natural batching: what queued up while the
        owner was busy), waiting up to `wait` s for anything to do."""
        items = self._items
        if not items and wait:
            self._ready.wait(wait)
        self._ready.clear()
        taken = [items.popleft() for _ in range(min(limit, len(items)))]
        if items:
            self._ready.set()  # more than one batch waits: the next turn does not wait
        if not self._room.is_set() and len(items) < self._limit:
            self._room.set()
        return taken

    def confirms(self) -> list[Confirmed]:
        confirms = []
        while self._confirms:
            confirms.append(self._confirms.popleft())
        return confirms

    def queued(self) -> int:
        return len(self._items)


class MqttSession:
    def __init__(self, *, url: str, node_id: str, prefix: str, handoff: Handoff,
                 counts: LocalCounter, instance: str = "1", protocol_version: str = "5",
                 monitor: bool = True, session_expiry_s: int = 3600, max_queued: int = 10000,
                 share_group: str = "", ingest: str = "auto", console_id: str = "",
                 keepalive_s: int = 15, reconnect_delay_s: tuple[float, float] = (1, 30),
                 profile_root: str = "", profile: bool = False):
        # TLS and credentials come with the URL and the settings (messages/mqtt_client.py).
        self.target = broker_target(url, protocol=protocol_version)
        self.url = self.target.display  # never the password: this one is logged
        self.node_id = node_id
        self.instance = instance
        self.client_id = client_id_for(node_id, instance, console_id)
        self.keepalive_s = keepalive_s
        self.probe_topic = protocol.probe_topic(prefix, self.client_id)
        self.v5 = protocol_version == "5"
        self.monitor = monitor
        self.session_expiry_s = session_expiry_s
        self.max_queued = max_queued
        self.reconnect_delay_s = reconnect_delay_s  # paho's (least, largest) wait
        self.handoff = handoff
        self.counts = counts
        # What the broker can do, as its CONNACK and $SYS told us (messages/broker_caps.py).
        self.caps: dict[str, Any] = {}
        # One group per console (settings.REACH_BRIDGE_SHARE_GROUP): two consoles on one
        # broker must each get every message, their own bridges only a share of it.
        self.share_group = share_group or f"reach-{node_id or 'anon'}"
        self.plan = IngestPlan(prefix=prefix, node_id=node_id, monitor=monitor,
                               share_group=self.share_group, probe_topic=self.probe_topic,
                               setting=ingest, v5=self.v5, caps=self.caps,
                               profile_root=profile_root, profile=profile)
        self.ingest_lock: IngestLock | None = None  # used in single mode only
        self._next_lock_try = 0.0
        self._outage_said = False  # single mode: the database-outage warning, once an outage
        self._subscribe_lock = threading.Lock()  # paho's thread and the owner both subscribe
        # (mid, filters) of the SUBSCRIBE whose SUBACK sets `listening`
        self._awaited_suback: tuple[int, list[str]] | None = None
        self.connected = threading.Event()
        # Connected AND subscribed to what this bridge must hear in its mode (shared: at once;
        # single: once it knows whether it holds the ingest lock).
        self.listening = threading.Event()
        self.generation = 0  # bumped by paho's thread on each CONNACK
        # Renewed (by paho's thread) each time the broker grants what this bridge must hear:
        # only probes sent after that prove anything (messages/probes.py).
        self.probes = ProbeChain()
        self.granted = threading.Event()  # a new grant: say the hearing on the next turn
        self.dropped_total: int | None = None
        self.connected_at = 0.0
        self._short_lives = 0  # connections in a row the broker closed within seconds
        self._caps_refreshed = 0.0
        self._stopping = False
        self.client: mqtt.Client | None = None

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        client = mqtt_client(target=self.target, client_id=self.client_id,
                             clean_session=False, manual_ack=True, lean=True)
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
        self.client = client
        # Used only if the broker cannot share subscriptions (decided on each CONNACK).
        self.ingest_lock = IngestLock(name=self.share_group)
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

    def stopping(self) -> None:
        """The bridge is stopping: a connection lost from now on is not news."""
        self._stopping = True

    def stop(self) -> None:
        """After the owner thread has stopped: let the lock go and close the connection."""
        self._stopping = True
        if self.ingest_lock is not None:
            self.ingest_lock.release()  # a standby takes over at once, not after a timeout
        if self.client is not None:
            self.client.disconnect()
            self.client.loop_stop()
            self.client = None
        if self.caps:
            self._caps_record(connected=False)  # the pages stop counting on this one

    # --- what the owner thread asks -------------------------------------------------------
    @property
    def ingest_mode(self) -> str:
        """"shared" or "single", decided on each CONNACK ("" before the first)."""
        return self.plan.mode

    def hears(self) -> tuple[datetime, datetime] | None:
        """Up to when this bridge has proved it hears the bus (roster/hearing.py), or None.
        A standby (single mode, without the ingest lock) hears nothing of the bus: if it
        said it did, leases could run out while nobody ingests their heartbeats."""
        heard = self.probes.heard
        if (self.connected.is_set() and self.plan.ingesting and self.listening.is_set()
                and heard is not None):
            return heard
        return None

    def publish(self, topic: str, payload: bytes, qos: int = 1,
                reply: tuple[str, bytes] | None = None) -> mqtt.MQTTMessageInfo | None:
        """`reply`: (Response Topic, Correlation Data), MQTT 5 only (the A2A-over-MQTT
        profile's requests: messages/profile_send.py)."""
        client = self.client
        if client is None:
            return None
        if reply is None:
            return client.publish(topic, payload, qos=qos)
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic, props.CorrelationData = reply
        return client.publish(topic, payload, qos=qos, properties=props)

    def ack(self, received: list[Received]) -> None:
        """After the commit: the broker may forget them."""
        client = self.client
        if client is None:
            return
        for r in received:
            # An id from an earlier connection may now name another message: leave those to
            # the broker's redelivery (the insert is idempotent).
            if r.qos > 0 and r.generation == self.generation:
                client.ack(r.mid, r.qos)

    def probe_send(self, now: float, *, behind: bool) -> None:
        """Owner thread: send the next probe, and call the connection dead when one sent a
        keepalive ago has still not come back (a connection that stalls without closing:
        paho alone would wait up to two keepalives, and the broker 1.5). Not while the owner
        is `behind` (paho then stops reading, probes included), and not for time it spent
        away (a database outage): only a probe that was sent and never answered counts."""
        client = self.client
        if client is None or not self.probes.nonce:
            return
        waited = self.probes.unanswered_for(now, connected_at=self.connected_at)
        if waited >= self.keepalive_s and not behind:
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

    def lock_turn(self, now: float) -> None:
        """Single mode (owner thread): take the ingest lock, or check the one held, about
        once a second, and (un)subscribe when that changes. A bridge that lost the broker
        lets the lock go, so a connected one ingests meanwhile."""
        lock, plan = self.ingest_lock, self.plan
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
            self._sync_subscriptions(self.client, then_listen=True)
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
        self._sync_subscriptions(self.client, then_listen=True)

    def caps_tick(self, now: float) -> None:
        """Owner thread: decide that `$SYS` counters do not come, and keep the entry fresh."""
        if (self.connected.is_set() and self.caps.get("sys_drops") is None
                and now - self.connected_at >= SYS_WAIT_S):
            self._caps_record(sys_drops=False)
        elif now - self._caps_refreshed >= REFRESH_S and self.caps:
            self._caps_refreshed = now
            self._caps_record()

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
        # Single mode listens once the ingest lock has been asked (lock_turn).
        self._sync_subscriptions(client, then_listen=(self.plan.mode == "shared"
                                                      or self.ingest_lock is None))
        self.connected.set()
        self.handoff.wake()  # what came due in the outbox while we were away
        log.info("MQTT bridge connected (session present: %s)", flags.session_present)

    def _on_connect_fail(self, client, userdata) -> None:
        # paho's reconnect loop swallowed the reason (TLS, DNS, refused): find it out, so the
        # log says it once and readiness can say it, rather than "connection failed" forever.
        self._caps_record(connected=False,
                          error=connect_failure_reason(self.target)
                          or f"the broker {self.url} closed the connection during CONNECT")

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
                    self.granted.set()  # the owner says so on its next turn, now
                    self.handoff.wake()
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
        lasted = time.monotonic() - self.connected_at if was_connected else None
        self._short_lives = self._short_lives + 1 if lasted is not None and lasted < 5 else 0
        if reason_code == 142 or self._short_lives == 3:  # 142: MQTT 5 "session taken over"
            log.error("another client with this id took over the MQTT session %s%s: two "
                      "consoles (or two bridges) share REACH_CONSOLE_ID, REACH_NODE_ID and "
                      "REACH_BRIDGE_INSTANCE; give each bridge its own", self.client_id,
                      "" if reason_code == 142 else
                      " (the broker closed it within seconds of each of its last 3 connects)")
        if reason_code != 142 and not self._stopping and was_connected:
            # Only a lost connection: a refused CONNECT was said (once) by _on_connect.
            log.warning("MQTT bridge disconnected (%s); paho reconnects", reason_code)
            self._caps_record(connected=False)

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        if message.topic == BROKER_DROPPED_TOPIC:
            if not self.caps.get("sys_drops"):
                self._caps_record(sys_drops=True)
            self._broker_dropped(message.payload)
            return
        if message.topic == self.probe_topic:
            probe = probe_decode(message.payload)
            if probe is not None:
                self.probes.noted_back()
                # In line with what was received before it: it proves those are stored.
                self.handoff.put(probe)
            else:
                self.counts["probe_malformed"] += 1
            return
        if message.topic[:1] == "$":
            # The A2A-over-MQTT profile (the only `$` tree subscribed but $SYS): what it says
            # in user properties (a card's presence) and whether the broker kept it.
            props = message.properties
            user = getattr(props, "UserProperty", None) or ()
            self.handoff.put(Received(
                message.topic, message.payload, message.mid, message.qos, self.generation,
                time.time(), retain=bool(message.retain), user=tuple(user),
                response_topic=getattr(props, "ResponseTopic", None) or "",
                correlation=getattr(props, "CorrelationData", None) or b""))
            return
        ids = getattr(message.properties, "SubscriptionIdentifier", None) or ()
        copy = PLAIN_INBOX_SID in ids and bool(self.plan.plain_inbox())
        self.handoff.put(Received(message.topic, message.payload, message.mid, message.qos,
                                  self.generation, time.time(), copy))

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        failure = str(reason_code) if getattr(reason_code, "is_failure", False) else ""
        self.handoff.confirm(Confirmed(mid, failure, timezone.now()))

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
            profile = plan.profile_subscriptions()
            if profile:
                client.subscribe(profile)
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
        lock = self.ingest_lock
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

    # --- the broker's capabilities and drops ------------------------------------------------
    def _caps_record(self, **facts: Any) -> None:
        self.caps.update(facts)
        broker_caps_record(instance=self.client_id, url=self.url,
                           protocol=self.target.protocol, **facts)

    def _caps_connected(self, properties) -> None:
        """A CONNACK that accepted us: what it says the broker can do. Whether `$SYS` drop
        counters come is known later (caps_tick)."""
        self.connected_at = time.monotonic()
        self._caps_record(connected=True, error="",
                          **connack_caps(v5=self.v5, properties=properties,
                                         requested_expiry_s=self.session_expiry_s))

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
