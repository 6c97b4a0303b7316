"""The MQTT bridge's owner loop: the one thread that turns what the broker hands over into
rows, and due rows into publishes.

The MQTT session (messages/mqtt_session.py) owns the paho client, the connection and the
subscriptions; paho's network thread only hands work over. Each turn of the owner loop:

    take     what paho handed over (messages and probes, in order) and the PUBACKs
    confirm  what the broker said of our publishes (messages/puback.py)
    ingest   the messages, one transaction a batch (messages/inbound.py)
    ack      them to the broker, only after the commit (`manual_ack`)
    publish  due rows of the outbox (messages/outbox.py)

and, on their own clocks, the probe whose return proves up to when the console hears the bus
(roster/hearing.py), the console agents' heartbeat and the counters. RELIABILITY.md lists
the failures this is built around.
"""

from __future__ import annotations

import logging
import random
import threading
import time
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

from messages import protocol
from messages.handlers import (
    LOCAL_HANDLERS,
    console_agents_heartbeat,
    console_agents_register,
    console_agents_renew,
)
from messages.inbound import Incoming, IngestResult, messages_ingest
from messages.models import Message
from messages.mqtt_session import Confirmed, Handoff, MqttSession, Received
from messages.outbox import (
    OutboxListener,
    outbox_claim,
    outbox_defer,
    outbox_subscribe,
    outbox_unsubscribe,
)
from messages.probes import Probe
from messages.profile_send import profile_encode, publish_properties
from messages.profile_traffic import ProfileFrame, profile_traffic_ingest
from messages.puback import Puback, pubacks_apply
from messages.rows import row_encode
from reachconsole.core import identity
from reachconsole.core.logs import log_fields
from reachconsole.core.metrics import LocalCounter
from roster.hearing import PROBE_EVERY_S, hearing_lost, hearing_record
from roster.profile import (
    SOURCE_PROPERTY,
    STATUS_PROPERTY,
    CardFrame,
    card_counted,
)

log = logging.getLogger(__name__)

RETRY_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
# The database or the cache (Redis: the idempotency window) is down: wait, don't skip.
INFRA_DOWN = (OperationalError, InterfaceError, redis.exceptions.ConnectionError,
              redis.exceptions.TimeoutError)
HEARING_EVERY_S = 1.0


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
                 reconnect_delay_s: tuple[float, float] = (1, 30),
                 a2a_profile: bool | None = None):
        self.node_id = node_id
        # The A2A-over-MQTT profile's cards (roster/profile.py): MQTT 5 only, since an
        # agent's presence is a user property.
        if a2a_profile is None:
            a2a_profile = settings.REACH_A2A_PROFILE
        if a2a_profile and protocol_version != "5":
            log.warning("the A2A-over-MQTT profile needs MQTT 5; with MQTT_PROTOCOL=%s its "
                        "agents' cards are not heard", protocol_version)
        profile_root = settings.REACH_A2A_ROOT
        self.prefix = prefix
        self.max_queued = max_queued
        self.batch = batch
        self.heartbeat_s = heartbeat_ms / 1000
        self.counts = LocalCounter()
        self.handoff = Handoff()
        self.session = MqttSession(
            url=url, node_id=node_id, prefix=prefix, handoff=self.handoff, counts=self.counts,
            instance=instance, protocol_version=protocol_version, monitor=monitor,
            session_expiry_s=session_expiry_s, max_queued=max_queued, share_group=share_group,
            ingest=ingest, console_id=console_id, keepalive_s=keepalive_s,
            reconnect_delay_s=reconnect_delay_s, profile_root=profile_root,
            profile=a2a_profile)
        self.client_id = self.session.client_id
        self.url = self.session.url  # never the password: this one is logged
        # paho mid → (a2a_message pk, whether it is a task request, the request whose
        # response waits for this ACK or ""), until the PUBACK
        # mid → (row pk, whether a request, the request its response waits for, the
        # request's time to be answered in ms: 0 for REACH_ACK_TIMEOUT_MS)
        self._pending: dict[int, tuple[int, bool, str, int]] = {}
        self._outbox_due = threading.Event()
        self._next_poll = 0.0
        self._listener = OutboxListener(self._wake_outbox)
        self._hearing = False
        self._last_hearing = 0.0
        self._last_probe = 0.0  # monotonic, when the owner last sent one
        self._last_db_warning = 0.0
        self._last_profile_error = -60.0
        self._stop = threading.Event()
        self._owner: threading.Thread | None = None
        self._last_heartbeat = 0.0
        self._last_flush = 0.0
        self._seen_generation = 0  # the last connection the owner noticed
        self._counted_generation = 0  # connections counted so far (reconnects metric)

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
        self._register_local_agents()
        self.session.start()
        outbox_subscribe(self._wake_outbox)
        self._listener.start()
        self._owner = threading.Thread(target=self._run, name="mqtt-bridge", daemon=True)
        self._owner.start()
        log.info("MQTT bridge %s → %s (monitor %s)", self.client_id, self.url,
                 "on" if self.session.monitor else "off")

    def stop(self, timeout: float = 10.0) -> None:
        outbox_unsubscribe(self._wake_outbox)
        self._stop.set()
        self.session.stopping()
        self.handoff.wake()  # the owner's wait ends now, not at its timeout
        self._listener.stop()
        if self._owner is not None:
            self._owner.join(timeout)
            self._owner = None
        self.session.stop()
        self.counts.flush()

    def wait_connected(self, timeout: float = 10.0) -> bool:
        """Connected and subscribed for its ingest mode (MqttSession.listening)."""
        return self.session.listening.wait(timeout)

    def _wake_outbox(self) -> None:
        """Rows came due (any thread; never blocks)."""
        self._outbox_due.set()
        self.handoff.wake()

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
        session = self.session
        items = self.handoff.take(wait, self.batch)
        received = [i for i in items if isinstance(i, Received)]
        probes = [i for i in items if isinstance(i, Probe)]
        # PUBACKs first: a receiver's answer cannot precede the broker taking the request,
        # and the record should not say so.
        confirms = self.handoff.confirms()
        try:
            if confirms:
                self._confirm(confirms)
        finally:
            # Whatever happened to the confirms, what was received is stored (and only then
            # acknowledged): dropped here, it would not be redelivered on a live connection.
            if received:
                self._ingest(received)
        if probes:
            session.probes.back(probes)  # after the ingest: what came before them is stored
        now = time.monotonic()
        found = bool(items)
        self._guard_db(lambda: session.lock_turn(now))
        connected = session.connected.is_set()
        if connected and session.generation != self._seen_generation:
            self._seen_generation = session.generation
            self._outbox_due.set()  # what came due while we were away
        if connected and (self._outbox_due.is_set() or now >= self._next_poll):
            self._outbox_due.clear()
            self._next_poll = now + settings.REACH_OUTBOX_POLL_S
            found = self._guard_db(self._publish_due) or found
        if session.connected.is_set() and now - self._last_probe >= PROBE_EVERY_S:
            self._last_probe = now
            session.probe_send(now, behind=self.handoff.queued() >= self.batch)
        if session.granted.is_set() or now - self._last_hearing >= HEARING_EVERY_S:
            # A new grant of the subscriptions is said on this turn, not up to a second
            # later: readiness and /metrics should not lag the ingest.
            session.granted.clear()
            self._last_hearing = now
            self._guard_db(self._report_hearing)
            session.caps_tick(now)
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
        generation = self.session.generation
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

    def _report_hearing(self) -> None:
        """Whether the console hears the bus decides whether leases may run out, and up to
        when it may judge anyone's silence (roster/hearing.py): the chain of probes back."""
        heard = self.session.hears()
        if heard is not None:
            hearing_record(instance=self.client_id, since=heard[0], through=heard[1])
            self._hearing = True
        elif self._hearing:
            hearing_lost(instance=self.client_id)
            self._hearing = False

    # --- in: store, then acknowledge ----------------------------------------------------------
    def _ingest(self, received: list[Received]) -> None:
        # One message through both of our subscriptions to the own inbox (plain and shared)
        # comes twice, usually in one batch: the shared copy is kept, the plain one is
        # dropped. Every copy is still acknowledged after the commit.
        kept: dict[tuple[str, bytes], Incoming] = {}
        cards: list[CardFrame] = []
        traffic: list[ProfileFrame] = []
        discovery = f"{settings.REACH_A2A_ROOT}/discovery/"
        for r in received:
            if r.topic[:1] == "$":  # the A2A-over-MQTT profile
                if not self.session.plan.profile:
                    # An earlier run's subscription, until its UNSUBSCRIBE is through.
                    self.counts["profile_unsubscribed"] += 1
                elif r.topic.startswith(discovery):
                    user = dict(r.user)
                    cards.append(CardFrame(r.topic, r.payload, user.get(STATUS_PROPERTY, ""),
                                           user.get(SOURCE_PROPERTY, ""),
                                           datetime.fromtimestamp(r.received_at, tz=UTC)))
                elif self.session.plan.profile_traffic():
                    traffic.append(ProfileFrame(r.topic, r.payload, r.user, r.response_topic,
                                                r.correlation, r.retain))
                else:
                    self.counts["profile_unsubscribed"] += 1
                continue
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
                    result = (messages_ingest(batch=batch, node_id=self.node_id,
                                              prefix=self.prefix, receiver=self.client_id)
                              if batch else IngestResult())
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
        if cards and not self._cards_apply(cards):
            log.error("stopping with %d Agent Cards unapplied; the broker keeps them",
                      len(cards))
            return  # nothing acknowledged: the broker sends the batch again
        if traffic and not self._traffic_apply(traffic):
            log.error("stopping with %d A2A-over-MQTT messages unstored; the broker keeps "
                      "them", len(traffic))
            return
        self.counts.update(result.counts)
        self.counts[f"ingested:{self.client_id}"] += result.counts["stored"]
        self.session.ack(received)
        if result.to_publish:
            self._outbox_due.set()  # answers and freed work: publish them on this turn

    def _outage_waited(self, work, what: str) -> bool:
        """Run `work` until the database (or the cache) lets it through, backing off as the
        batch's messages do; False when the bridge stops first (nothing of the batch is
        acknowledged then, and the broker sends it again)."""
        attempt = 0
        while True:
            try:
                connection_keep()
                work()
                return True
            except INFRA_DOWN as exc:
                if self._stop.is_set():
                    return False
                delay = RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)]
                attempt += 1
                log.warning("database unavailable for %s (%s); retrying in %.1f s", what,
                            exc, delay)
                time.sleep(delay)

    def _cards_apply(self, cards: list[CardFrame]) -> bool:
        """After the batch's messages: each card on its own (one agent's, its own
        transaction), each counted once it is applied (a card applied twice writes nothing
        the second time)."""
        for card in cards:
            def apply(card=card) -> None:
                self.counts[card_counted(card)] += 1

            if not self._outage_waited(apply, "Agent Cards"):
                return False
        return True

    def _traffic_apply(self, frames: list[ProfileFrame]) -> bool:
        """The profile's observed traffic, one transaction (messages/profile_traffic.py); a
        batch that fails otherwise goes again frame by frame, and a frame that fails alone
        is logged, counted and dropped (it is an observation: a frame that breaks the
        console must not stop its bridge)."""
        def ingest() -> None:
            try:
                self.counts.update(profile_traffic_ingest(frames, now=timezone.now()))
                return
            except INFRA_DOWN:
                raise
            except Exception:
                # Anyone on the bus can send such frames: said once a minute, not once a
                # frame.
                self._say_once_a_minute("a batch of %d A2A-over-MQTT messages failed; "
                                        "isolating the bad ones", len(frames))
            for frame in frames:
                try:
                    self.counts.update(profile_traffic_ingest([frame], now=timezone.now()))
                except INFRA_DOWN:
                    raise
                except Exception:
                    self._say_once_a_minute("an A2A-over-MQTT message on %s could not be "
                                            "stored; dropped", frame.topic[:200])
                    self.counts["rejected:profile_unstorable"] += 1

        return self._outage_waited(ingest, "A2A-over-MQTT traffic")

    def _say_once_a_minute(self, message: str, *args: object) -> None:
        """log.exception for what the bus can cause at will, at most once a minute."""
        now = time.monotonic()
        if now - self._last_profile_error >= 60:
            self._last_profile_error = now
            log.exception(message, *args)

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

    # --- out: claim, publish, confirm ---------------------------------------------------------
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

    def _publish(self, rows: list[Message]) -> None:
        if self.session.client is None or not rows:
            return
        failed: list[Puback] = []
        deferred: list[int] = []
        released: list[str] = []
        now = timezone.now()
        for row in rows:
            profile = publish_properties(row)
            try:
                if profile is not None and not self.session.v5:
                    raise ValueError("the broker connection speaks MQTT 3.1.1, and the "
                                     "A2A-over-MQTT profile needs MQTT 5 (Response Topic, "
                                     "Correlation Data): set MQTT_PROTOCOL=5")
                data = profile_encode(row) if profile is not None else row_encode(row)
            except (ValueError, TypeError) as exc:
                failed.append(Puback(pk=row.pk, request=False, at=now,
                                     not_sent=str(exc) or type(exc).__name__))
                released += filter(None, [_response_waits_for(row)])
                continue
            topic = row.topic or protocol.inbox_topic(self.prefix, row.target_node_id)
            info = self.session.publish(topic, data, qos=1, reply=profile)
            if info is None:
                break  # stopping: the rows stay SENT, their claim runs out
            if info.rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                # NO_CONN: paho keeps a QoS 1 message and sends it on reconnect.
                request = row.message_type == protocol.MessageType.TASK_REQUEST
                self._pending[info.mid] = (row.pk, request, _response_waits_for(row),
                                           # the profile's first-reply timeout
                                           settings.REACH_A2A_FIRST_REPLY_MS if profile else 0)
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

    def _confirm(self, confirms: list[Confirmed]) -> None:
        pubacks: list[Puback] = []
        released: list[str] = []
        for item in confirms:
            pk, request, waiting, ack_ms = self._pending.pop(item.mid, (None, False, "", 0))
            if pk is None:
                continue
            if waiting:  # the broker has the ACK (or refused it): the response may go now
                released.append(waiting)
            pubacks.append(Puback(pk=pk, request=request, at=item.at,
                                  broker_refused=item.failure, ack_ms=ack_ms))
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

    # --- the console's own agents -------------------------------------------------------------
    def _register_local_agents(self) -> None:
        if not self.node_id:
            return
        try:
            console_agents_register(node_id=self.node_id)
        except Exception:
            log.exception("could not register the console's own agents")

    def _heartbeat(self) -> None:
        heartbeat_ms = int(self.heartbeat_s * 1000)
        self.session.publish(protocol.heartbeat_topic(self.prefix, self.node_id),
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
            items = self.handoff.take(0, self.batch)
            if not items:
                break
            received = [i for i in items if isinstance(i, Received)]
            if received:
                self._ingest(received)
            confirms = self.handoff.confirms()
            if confirms:
                self._confirm(confirms)

    def stats(self) -> dict[str, Any]:
        return {"connected": self.session.connected.is_set(), "queued": self.handoff.queued(),
                "pending_pubacks": len(self._pending),
                "counts": dict(self.counts)}
