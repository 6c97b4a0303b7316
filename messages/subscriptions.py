"""What one bridge subscribes to in its ingest mode, and what it must drop: the decisions
only (no paho, no database), so each can be read and tested alone. The bridge
(messages/mqtt_session.py) asks for them on each CONNACK, SUBACK and turn of the ingest lock.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from paho.mqtt.subscribeoptions import SubscribeOptions

from messages import protocol

BROKER_DROPPED_TOPIC = "$SYS/broker/publish/messages/dropped"
# How bridges split the inbound topics (README "Scaling out"): "auto" shares them when the
# broker can (MQTT 5 without SharedSubscriptionAvailable = 0), else one bridge ingests.
INGEST_CHOICES = ("auto", "shared", "single")
# The subscription identifier of the plain own-inbox subscription (below): how a copy
# through it is told from the shared group's.
PLAIN_INBOX_SID = 1

# The inbound topics (heartbeats, the inboxes) are the console's, not one bridge's: each
# message must be stored by exactly one of its bridges, so they are shared
# (`$share/{group}/…`, MQTT 5) or, where the broker cannot share, taken by the one bridge
# that holds the ingest lock (messages/ingest_lock.py). That includes the console's own
# inbox: a request to the console is consumed once per node (PROTOCOL.md), not once per
# bridge. The `$SYS` drop counter is each bridge's alone: it is one small message per
# broker interval, and each bridge computes drops as the difference from the last total
# it saw, which a share of the readings would get wrong. The outbox needs no
# subscription (rows are claimed in the database, `skip_locked`), and the console's own
# sends come back through the shared inbox wildcard like any observed traffic.
#
# One exception, found in the broker-restart fault run: Mosquitto (2.0.11 here) does not
# restore shared subscriptions from its persistence, so after a broker restart a message
# published before the bridges have subscribed again matches nobody and is gone. For
# observed traffic and heartbeats (QoS 0) that is a gap in a record; for the console's
# own inbox it is an answer the console waits for (a send stuck ACKED). So every bridge
# also keeps a plain subscription to its own inbox, which a persistent session keeps
# over a restart (and which hears what a share handed to a stopped member's session).
# That makes one publish arrive once through the group and once per bridge plainly;
# the plain subscription carries a subscription identifier (PLAIN_INBOX_SID), so each
# copy says which way it came, and a plain copy is only ever a stand-in: it is stored
# and acted on when it is the first to arrive, and never answered, counted or refused
# as a repeat (messages/inbound.py, "copies"). One message in, one answer out. A broker
# without subscription identifiers gets no plain subscription: the shared group alone.
#
# The heartbeats are not shared either. A share of them goes to every member of the
# group, a bridge that stopped included (its persistent session stays a member until it
# expires, an hour by default), and heartbeats are QoS 0, so its share was simply lost:
# the console heard 20 of 39 heartbeats while one of two bridges was away, and called
# live agents EXPIRED. And a bridge's probe (roster/hearing.py) can only prove that it
# heard everything if it gets everything. So every bridge subscribes to them itself, and
# the first to claim a heartbeat applies it (messages/inbound.py heartbeats_first_copy).


class IngestPlan:
    """The subscriptions of one bridge. `mode` ("shared" or "single") is decided on each
    CONNACK (`decide`); in single mode `ingesting` follows the ingest lock
    (messages/ingest_lock.py) and `lock_asked` says whether this connection has asked for it
    yet. `caps` is the bridge's record of what the broker can do (messages/broker_caps.py),
    read as it changes."""

    def __init__(self, *, prefix: str, node_id: str, monitor: bool, share_group: str,
                 probe_topic: str, setting: str, v5: bool, caps: dict[str, Any],
                 profile_root: str = "", profile: bool = True):
        if setting not in INGEST_CHOICES:
            raise ValueError(f"ingest {setting!r}: use one of {', '.join(INGEST_CHOICES)}")
        self.prefix = prefix
        self.node_id = node_id
        self.monitor = monitor
        self.share_group = share_group
        self.probe_topic = probe_topic
        self.setting = setting
        self.v5 = v5
        self.caps = caps
        # The A2A-over-MQTT profile's tree (roster/profile.py, messages/profile_traffic.py),
        # MQTT 5 only; `profile` says whether it is heard (when not, an earlier run's
        # subscriptions to it are stale).
        self.profile_root = profile_root if v5 else ""
        self.profile = profile
        self.mode = ""
        self.ingesting = False  # whether the inbound subscriptions are (to be) in place
        # Single mode: whether this connection has asked for the ingest lock yet. Until it
        # has, nothing inbound is unsubscribed: its session may hold what the broker kept
        # for it while it was away (NATS drops those with the subscription), and it may be
        # the bridge that takes the lock a moment later.
        self.lock_asked = False
        self.shares_refused = False  # a SUBACK said 0x9E: shared subscriptions not supported

    def decide(self, *, lock_held: bool) -> str:
        """Shared subscriptions when the broker allows them, else one active bridge. Returns
        why, when the mode changed ("" when it did not)."""
        if self.setting != "auto":
            mode, why = self.setting, f"REACH_BRIDGE_INGEST={self.setting}"
        elif not self.v5:
            mode, why = "single", "MQTT 3.1.1 has no shared subscriptions"
        elif not self.caps.get("shared_subscriptions", True):
            mode, why = "single", "the broker's CONNACK says SharedSubscriptionAvailable = 0"
        elif self.shares_refused:
            mode, why = "single", "the broker refused a shared subscription"
        else:
            mode, why = "shared", "the MQTT 5 broker allows shared subscriptions"
        if mode == self.mode:
            return ""
        self.mode = mode
        self.ingesting = mode == "shared" or lock_held
        return why

    def inbound_topics(self) -> list[tuple[str, int]]:
        subs = [(protocol.heartbeat_wildcard(self.prefix), 0)]
        if self.monitor:
            # The wildcard covers our own inbox too (its topic makes those RECV); a second,
            # overlapping subscription would have the broker deliver them twice.
            subs.append((protocol.inbox_wildcard(self.prefix), 1))
        elif self.node_id:
            subs.append((protocol.inbox_topic(self.prefix, self.node_id), 1))
        return subs

    def shared(self, topic: str) -> str:
        return f"$share/{self.share_group}/{topic}"

    def own_inbox(self) -> str:
        return protocol.inbox_topic(self.prefix, self.node_id) if self.node_id else ""

    def subscriptions(self) -> list[tuple[str, int]]:
        # Brokers that publish $SYS counters (Mosquitto) report their drops here. The probe
        # is each bridge's own, in every mode: a standby must notice a dead connection too.
        subs = [(BROKER_DROPPED_TOPIC, 0), (self.probe_topic, 0)]
        if not self.ingesting:
            return subs
        if self.mode != "shared":
            return subs + self.inbound_topics()
        beats = protocol.heartbeat_wildcard(self.prefix)
        subs += [(self.shared(t), q) for t, q in self.inbound_topics() if t != beats]
        subs.append((beats, 0))  # every bridge hears every heartbeat: see above
        return subs

    def profile_discovery(self) -> str:
        return f"{self.profile_root}/discovery/+/+/+" if self.profile_root else ""

    def _profile_trees(self) -> list[str]:
        if not self.profile_root:
            return []
        return [f"{self.profile_root}/{tree}/#" for tree in ("request", "reply", "event")]

    def profile_traffic(self) -> list[str]:
        """The profile's requests, replies and events, observed in monitor mode; without it,
        the replies to the console's own requests only (messages/profile_send.py)."""
        if not (self.profile and self.profile_root):
            return []
        if self.monitor:
            return self._profile_trees()
        return [f"{self.profile_root}/reply/{settings.REACH_A2A_REQUESTER}/replies"]

    def profile_heard(self) -> list[str]:
        """The profile's filters this bridge holds while it ingests."""
        if not (self.profile and self.profile_root):
            return []
        return [self.profile_discovery(), *self.profile_traffic()]

    def _profile_unheard(self) -> list[str]:
        """The profile's filters an earlier run (the profile or monitor mode on) may have
        left in the persistent session, that this one must not hold."""
        heard = self.profile_heard()
        every = [self.profile_discovery(), *self._profile_trees()] if self.profile_root else []
        return [f for f in every if f not in heard]

    def profile_subscriptions(self) -> list[tuple[str, int | SubscribeOptions]]:
        """The profile's retained Agent Cards and its traffic, plain, heard by every bridge
        that ingests, as the heartbeats are. Cards: a broker hands retained messages to plain
        subscriptions only, and a card already on the roster writes nothing. Traffic:
        Mosquitto (2.0) delivers nothing through a shared filter of a `$` tree
        (`$share/g/$a2a/…`, tried), so every bridge stores each message and the insert keeps
        one (its message id is made of what identifies it), and only the bridge that
        inserted a reply moves its request. Subscribed in a packet of their own
        (MqttSession): a broker that refuses `$a2a/…` leaves the native dialect heard."""
        if not (self.ingesting and self.profile and self.profile_root):
            return []
        # Retain As Published: a request published retained (which the profile's rules flag)
        # reaches a live subscriber with its retain flag, which it would otherwise lose.
        return [(self.profile_discovery(), 1),
                *((t, SubscribeOptions(qos=1, retainAsPublished=True))
                  for t in self.profile_traffic())]

    def plain_inbox(self) -> str:
        """The own inbox's plain subscription beside the shared one (see above), or ""."""
        if (self.ingesting and self.mode == "shared"
                and self.caps.get("subscription_identifiers") is not False):
            return self.own_inbox()
        return ""

    def stale_filters(self) -> list[str]:
        """Inbound filters this bridge must not hold now: its persistent session keeps what
        an earlier run subscribed (another mode, or the ingest lock it no longer holds), and
        the broker would go on delivering a copy of every message to it."""
        plain = [t for t, _ in self.inbound_topics()]
        beats = protocol.heartbeat_wildcard(self.prefix)
        if self.mode == "shared":
            # The shared heartbeat filter of an earlier version, too (see above), and the
            # plain own inbox when the broker cannot say which copy is which.
            own = self.own_inbox()
            # What a run with the other REACH_MONITOR left: the other shared inbox filter
            # (the own inbox through it twice, neither copy marked) and the plain wildcard.
            wildcard = protocol.inbox_wildcard(self.prefix)
            other = ([self.shared(own)] if own else []) if self.monitor else [
                self.shared(wildcard), wildcard]
            return [t for t in plain if t not in (own, beats)] + [self.shared(beats)] + (
                [own] if own and not self.plain_inbox() else []) + other + (
                self._profile_unheard())
        stale = ([] if self.ingesting or not self.lock_asked else
                 plain + self.profile_heard()) + self._profile_unheard()
        if self.monitor and self.own_inbox():
            stale.append(self.own_inbox())  # the plain own inbox of a shared-mode run
        if self.caps.get("shared_subscriptions"):
            # Only a broker that takes `$share/` filters is sent them (single mode by
            # setting); to one without, even an UNSUBSCRIBE of one may be a protocol error.
            stale += [self.shared(t) for t in plain]
        return stale
