"""The roster: which agents exist, where they live, and whether their lease still holds."""

from __future__ import annotations

import re
from datetime import datetime, timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

NAMESPACE_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}(\.[A-Za-z0-9][A-Za-z0-9_-]{0,63}){0,7}$")
NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


# The agents the console hosts itself (messages/handlers.py LOCAL_HANDLERS, which a test holds
# equal to this), registered by its bridge on REACH_NODE_ID. Named here, in the roster, so that
# the roster and the directory can tell them apart without importing the messages app.
CONSOLE_AGENTS = frozenset({"ops.probe"})


def is_console_agent(agent_id: str, node_id: str | None = None) -> bool:
    """The console's own: one of its local agents, or anything on its own node (which runs no
    consumer but the console's). Only the console registers, renews or removes these."""
    return agent_id in CONSOLE_AGENTS or (
        node_id is not None and bool(settings.REACH_NODE_ID) and node_id == settings.REACH_NODE_ID
    )


def stale_cutoff(hearing) -> datetime | None:
    """Agents last heard before this have missed two heartbeats in a row, over time the
    console heard (`hearing`: roster.hearing.Hearing): stale. None when the console itself
    has not heard the bus for two heartbeats (down, restarting, stalled): it cannot tell a
    silent agent from its own deafness, so nothing is stale."""
    if hearing is None:
        return None
    return hearing.cutoff(timedelta(milliseconds=2 * settings.REACH_HEARTBEAT_MS))


def lapse_cutoff(hearing) -> datetime | None:
    """Leases that ended before this have lapsed: the moment up to which the console has
    proof it heard the bus (roster.hearing). None until it has heard for one full lease TTL:
    an outage of the console never ends an agent's lease, and after it every agent gets a
    whole TTL to be heard."""
    if hearing is None:
        return None
    return hearing.through_once_heard_for(timedelta(milliseconds=settings.REACH_LEASE_TTL_MS))


class Namespace(models.Model):
    name = models.CharField(max_length=64, unique=True)
    description = models.TextField(blank=True)
    open_to_other_namespaces = models.BooleanField(
        default=False,
        help_text="Agents of other namespaces may send to this namespace's agents, and "
        "capability routing may pick them",
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Consistency(models.TextChoices):
    """What the last reconciliation (roster/reconcile.py) said of a node, and so of every
    agent the roster places on it."""

    OK = "OK", "listed and live"
    STALE = "STALE", "not in the node set, retired, or silent: not routable"
    UNKNOWN = "UNKNOWN", "not known: the authority could not be read, or nothing heard yet"


class ClusterNode(models.Model):
    class Status(models.TextChoices):
        # Named by a registration, never heard on the bus: nothing proves it runs yet.
        REGISTERED = "REGISTERED", "registered, never heard"
        ONLINE = "ONLINE", "online"
        DOWN = "DOWN", "down"  # known, but silent for three heartbeat intervals

    node_id = models.CharField(max_length=128, unique=True)
    url = models.CharField(max_length=500, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices,
                              default=Status.REGISTERED)
    # Null until the node sends a heartbeat: a registration alone does not prove it runs.
    last_seen_at = models.DateTimeField(null=True, blank=True, db_index=True)
    heartbeat_ms = models.PositiveIntegerField(null=True, blank=True)
    retired = models.BooleanField(default=False, help_text="Taken out of service by an operator")
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    # Written by reconciliation, and by the node sweep when a heard node falls silent
    # (roster/services.py nodes_sweep); routing reads them (a STALE node's agents get no work).
    consistency = models.CharField(max_length=8, choices=Consistency.choices,
                                   default=Consistency.UNKNOWN, editable=False)
    consistency_reason = models.CharField(max_length=300, blank=True, editable=False)
    # Whether its traffic is signed (messages/signing.py): the last heartbeat taken with a
    # signature that checks, the last taken without one, and the last message speaking for
    # it that was refused for its signature, with the reason. Written by the bridge.
    signed_at = models.DateTimeField(null=True, blank=True, editable=False)
    unsigned_at = models.DateTimeField(null=True, blank=True, editable=False)
    signature_refused_at = models.DateTimeField(null=True, blank=True, editable=False)
    signature_refused = models.CharField(max_length=300, blank=True, editable=False)

    class Meta:
        ordering = ["node_id"]
        permissions = [
            ("reconcile_cluster", "Can run reconciliation from the cluster page"),
            ("manage_node", "Can drain and retire a whole node from the cluster page"),
        ]

    def __str__(self) -> str:
        return self.node_id

    @property
    def signing(self) -> str:
        """What its last heartbeat said of its signing: "signed", "unsigned" or "" (none
        heard since the console began to record it)."""
        if self.signed_at and (not self.unsigned_at or self.signed_at >= self.unsigned_at):
            return "signed"
        return "unsigned" if self.unsigned_at else ""

    def seen_within(self, window: timedelta, now: datetime | None = None) -> bool:
        """Whether the node was heard from on the bus within `window` of `now`."""
        if self.last_seen_at is None:
            return False
        return (now or timezone.now()) - self.last_seen_at <= window


class Dialect(models.TextChoices):
    NATIVE = "native", "native envelope"
    A2A_MQTT = "a2a-mqtt", "A2A over MQTT"


# The one node row the A2A-over-MQTT profile's agents sit on (roster/profile.py): the broker
# delivers to them, no node of the cluster does; it sends no heartbeat and is no member of
# the cluster's node set, so the node sweep and reconciliation leave it alone.
PROFILE_NODE_ID = "a2a-mqtt"


class Agent(models.Model):
    class Status(models.TextChoices):
        ONLINE = "ONLINE", "online"
        DRAINING = "DRAINING", "draining"
        OFFLINE = "OFFLINE", "offline"

    namespace = models.ForeignKey(Namespace, on_delete=models.PROTECT, related_name="agents")
    # As long as the longest agent id: a one-letter namespace leaves 263 characters of name.
    name = models.CharField(max_length=265)
    # Unique through Meta.constraints, not unique=True, which on PostgreSQL also builds a
    # varchar_pattern_ops index for LIKE 'x%' that no query runs (see the indexes below).
    agent_id = models.CharField(max_length=265)
    # The capability segment (last segment of the name), stored by agent_register so the
    # directory can look it up by index.
    segment = models.CharField(max_length=64, default="")
    node = models.ForeignKey(ClusterNode, on_delete=models.PROTECT, related_name="agents")
    version = models.CharField(max_length=64, blank=True)
    endpoint = models.CharField(max_length=500, blank=True)
    owner = models.CharField(max_length=128, blank=True)
    capabilities = models.JSONField(default=list, blank=True)
    groups = models.JSONField(default=list, blank=True)
    metadata = models.JSONField(default=dict, blank=True)
    max_inflight = models.PositiveIntegerField(default=8)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ONLINE)
    lease_expires_at = models.DateTimeField()
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    drained_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    inflight = models.PositiveIntegerField(default=0)
    queue_depth = models.PositiveIntegerField(default=0)
    registered_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(auto_now=True)
    # The A2A-over-MQTT profile's agents (roster/profile.py): registered by their retained
    # Agent Card, kept verbatim; their presence is the broker's word (the card's
    # a2a-status and a2a-status-source, since when), not a lease. A card refused after a
    # good one is kept here for the agent's page, the good one still standing.
    dialect = models.CharField(max_length=16, choices=Dialect.choices, default=Dialect.NATIVE)
    card = models.TextField(blank=True)
    presence_source = models.CharField(max_length=8, blank=True)
    presence_since = models.DateTimeField(null=True, blank=True)
    card_refused = models.CharField(max_length=300, blank=True)
    card_refused_at = models.DateTimeField(null=True, blank=True)
    # When the bridge that applied the last card heard it: every bridge applies every card,
    # so one that lags must not replay an older card over a newer one.
    card_heard_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["agent_id"]
        # No index mentions a column the lease sweep writes (status, expired_at, inflight,
        # updated_at), so its update of a lapsed row is HOT: one new row version on the same
        # page (fillfactor 45, migration 0008) and no index entry at all. The sweep finds
        # its rows through LeaseDeadline instead. Every index here is read by a query named
        # beside it, and each costs every heartbeat one more entry (docs/performance.md).
        constraints = [
            # agent_id = %s (the directory's first level, every API call by id), agent_id__in
            # (heartbeats), agent_id > cursor (API paging).
            models.UniqueConstraint(fields=["agent_id"], name="roster_agent_agent_id_uniq"),
        ]
        indexes = [
            # The directory's third level: segment = %s (directory/resolver.py).
            models.Index(fields=["segment"], name="agent_segment"),
        ]

    def __str__(self) -> str:
        return self.agent_id

    @property
    def capability_segment(self) -> str:
        """The last segment of the name: `tax` in `fin.tax`."""
        return self.name.rsplit(".", 1)[-1]

    def lease_remaining(self, now: datetime | None = None) -> timedelta:
        return self.lease_expires_at - (now or timezone.now())

    def is_stale(self, *, hearing) -> bool:
        """Missed two heartbeats in a row while its lease still runs (an early warning), or
        on a node reconciliation found STALE: what the directory calls STALE and routes no
        work to (directory/resolver.py). Read with its node (select_related). `hearing`: the
        console's (roster.hearing.bus_hearing), which silence is judged against."""
        if self.status == self.Status.OFFLINE or self.dialect != Dialect.NATIVE:
            return False  # a profile agent's presence is its card's (roster/profile.py)
        if self.node.consistency == Consistency.STALE:
            return True
        cutoff = stale_cutoff(hearing)
        return cutoff is not None and (self.last_heartbeat_at or self.registered_at) < cutoff

    def lease_lapsed(self, *, hearing) -> bool:
        if self.dialect != Dialect.NATIVE:
            return False  # no lease: the broker says when it is gone
        cutoff = lapse_cutoff(hearing)
        return cutoff is not None and self.lease_expires_at <= cutoff


class LeaseDeadline(models.Model):
    """When the lease sweep next looks at a live (ONLINE or DRAINING) agent: never later
    than its lease ends (`expires_at <= agent.lease_expires_at`).

    The sweep's queue, apart from the agent so that the agent's own row carries no index on
    what the sweep changes. Heartbeats leave it alone: a renewed lease only moves the agent's
    lease_expires_at later, so the deadline stays early, and when the sweep reaches it and
    finds the lease still running it moves the deadline to the lease's end. An agent that
    lapses leaves this table in the same statement that takes it OFFLINE (a delete writes
    no index entry). Registration and a revival write the row (roster/services.py); rows
    written outside the services are caught up by lease_deadlines_repair.
    """

    agent = models.OneToOneField(Agent, on_delete=models.CASCADE, primary_key=True,
                                 related_name="lease_deadline")
    # The sweep's claim: expires_at < now, oldest first.
    expires_at = models.DateTimeField(db_index=True)

    def __str__(self) -> str:
        return f"{self.agent_id} by {self.expires_at}"


class RosterEvent(models.Model):
    """One row per change of an agent's life: the history an operator reads afterwards.

    Kept by agent id (not a foreign key) so the history outlives a deregistered agent.
    """

    class Kind(models.TextChoices):
        REGISTERED = "REGISTERED", "registered"
        MOVED = "MOVED", "moved to another node"
        DRAINED = "DRAINED", "drain started"
        UNDRAINED = "UNDRAINED", "drain undone: takes new work again"
        DEREGISTERED = "DEREGISTERED", "deregistered"
        EXPIRED = "EXPIRED", "lease expired"
        REMOVED = "REMOVED", "removed after drain"
        REVIVED = "REVIVED", "back online"
        CONFLICT = "CONFLICT", "listed by another node"
        CARD = "CARD", "Agent Card changed"
        OFFLINE = "OFFLINE", "offline, by its Agent Card"

    # Indexed by migration 0008 outside the model: BRIN on PostgreSQL (a history row costs
    # it next to nothing, and the rows arrive in time order), a btree on SQLite. It serves
    # time ranges (the last hour's expiries, the admin's date drill-down), not ordering.
    at = models.DateTimeField(default=timezone.now)
    agent_id = models.CharField(max_length=265)
    node_id = models.CharField(max_length=128, blank=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    actor = models.CharField(max_length=150, blank=True, help_text="user, token or sweeper")
    detail = models.TextField(blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        # Few indexes: a lease sweep writes one history row per lapsed agent (100,000 in a
        # big one), and each index costs every row one more entry.
        indexes = [
            # Current conflicts (roster/selectors.py recent_conflicts): a handful of rows;
            # the sweep's EXPIRED and REMOVED rows write no entry into it.
            models.Index(fields=["at"], name="rosterevent_conflict_at",
                         condition=models.Q(kind="CONFLICT")),
            # One agent's history, newest first (the agent page). Not db_index=True on
            # agent_id: on PostgreSQL that adds a LIKE index no query uses, which every
            # history row (100,000 in a big lease sweep) would pay for.
            models.Index(fields=["agent_id", "-at"], name="rosterevent_agent_at"),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.agent_id} {self.kind}"


class BusHearing(models.Model):
    """One row per MQTT bridge: from when and up to when it has heard the bus without a gap
    (roster/hearing.py: `heard_at` is the send time of its latest probe back).

    The console judges leases and staleness only over time it could hear: while no bridge
    hears (disconnected, database or Redis down, worker restarting), no lease runs out, and
    once one hears again every agent gets a full lease TTL (PROTOCOL.md, "Outbound state
    machine"). Written by roster.hearing only.
    """

    instance = models.CharField(max_length=200, unique=True)
    # Null while this bridge does not hear the bus.
    hearing_since = models.DateTimeField(null=True, blank=True)
    heard_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.instance} since {self.hearing_since}"


class Reconciliation(models.Model):
    """One run of reconciliation: what the node authority said, how long it took, and which
    nodes changed class. Pages and the API read the last run instead of recomputing."""

    class Trigger(models.TextChoices):
        STARTUP = "startup", "worker start"
        SCHEDULE = "schedule", "periodic"
        OPERATOR = "operator", "an operator"

    started_at = models.DateTimeField(default=timezone.now, db_index=True)
    duration_ms = models.PositiveIntegerField(default=0)
    trigger = models.CharField(max_length=16, choices=Trigger.choices)
    actor = models.CharField(max_length=150, blank=True)
    # "roster" (the console's own node table and heartbeats) or the authority's URL.
    authority = models.CharField(max_length=500)
    authority_ok = models.BooleanField(default=True)
    detail = models.TextField(blank=True, help_text="why the authority could not be used")
    counts = models.JSONField(default=dict, help_text="agents per class: OK, STALE, UNKNOWN")
    changes = models.JSONField(default=list, help_text="nodes whose class changed, and why")

    class Meta:
        ordering = ["-started_at", "-id"]

    def __str__(self) -> str:
        return f"{self.started_at:%Y-%m-%d %H:%M:%S} {self.trigger} ({self.authority})"
