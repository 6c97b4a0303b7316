"""The `a2a_message` table: the only authority on what happened to a message."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.db import models
from django.db.models import Q
from django.utils import timezone

from messages.protocol import inbox_node_of


class Direction(models.TextChoices):
    SEND = "SEND", "sent by the console"
    RECV = "RECV", "received by the console"
    OBSERVED = "OBSERVED", "seen between other nodes"


class Status(models.TextChoices):
    SENT = "SENT", "written, not yet taken by the broker"
    PUBLISHED = "PUBLISHED", "taken by the broker (PUBACK)"
    ACKED = "ACKED", "acknowledged by the receiver"
    NACKED = "NACKED", "refused by the receiver"
    BUSY = "BUSY", "the receiver's queue was full"
    COMPLETED = "COMPLETED", "the response arrived"
    TASK_ERROR = "TASK_ERROR", "the response reported an error"
    LOCAL_CONSUMED = "LOCAL_CONSUMED", "handled by the console itself"
    UNDELIVERABLE = "UNDELIVERABLE", "no node could be resolved; not published"
    FAILED = "FAILED", "publishing failed"
    EXPIRED = "EXPIRED", "no acknowledgement in time"
    RETRYING = "RETRYING", "no answer; a new attempt is due"
    RETRIED = "RETRIED", "closed: a new attempt replaced it"
    CANCELED = "CANCELED", "canceled by an operator; nothing more is sent for it"
    RECV = "RECV", "received"
    OBSERVED = "OBSERVED", "observed on the bus"


FAILURE_STATUSES = frozenset(
    {Status.UNDELIVERABLE, Status.FAILED, Status.NACKED, Status.EXPIRED, Status.TASK_ERROR}
)
# A request in one of these has had its answer from the receiver.
ANSWERED_STATUSES = frozenset({Status.ACKED, Status.NACKED, Status.BUSY, Status.COMPLETED,
                               Status.TASK_ERROR})
# The work of a task is done: a response came (or a console agent answered in-process).
DONE_STATUSES = frozenset({Status.COMPLETED, Status.TASK_ERROR, Status.LOCAL_CONSUMED})
# A send is still "in flight" while the receiver has not answered it.
INFLIGHT_STATUSES = frozenset({Status.SENT, Status.PUBLISHED})
# A task request in one of these has not ended yet: its task deadline (`deadline_at`) ends
# it at the latest (messages/sweeps.py). An answer of ours is done once the broker has it
# (PUBLISHED, or ACKED by its receiver before our PUBACK was recorded).
OPEN_STATUSES = frozenset({Status.SENT, Status.PUBLISHED, Status.ACKED, Status.RETRYING})
# What an operator may cancel: nothing more is transmitted for these.
CANCELABLE_STATUSES = OPEN_STATUSES
# Every status a row never leaves on its own (a late response may still complete some).
FINAL_STATUSES = frozenset(set(Status.values) - OPEN_STATUSES - {Status.RECV, Status.OBSERVED})
# What an operator may send again.
RESENDABLE_STATUSES = frozenset(
    {Status.UNDELIVERABLE, Status.FAILED, Status.NACKED, Status.EXPIRED, Status.TASK_ERROR,
     Status.BUSY}
)

# Every status change a row may make, and the only place that says so: each status, with
# the statuses it may be reached from (SENT, RECV and OBSERVED are where rows start).
# messages.state.changes_apply refuses anything else; a caller may only narrow it.
# An answer also stops a retry that was only scheduled, and corrects a FAILED that only
# meant "the broker seemed not to take it"; a response completes any attempt, even one that
# had given up waiting (EXPIRED) or whose retry could not be made (UNDELIVERABLE, "attempt 2
# not made"): the work was done, and the record says so. Only the node the request went to
# can answer it (Message.answer_refusal), so a row never published gets no response.
_ANSWERED_FROM = frozenset({Status.SENT, Status.PUBLISHED, Status.OBSERVED, Status.RETRYING,
                            Status.FAILED})
_COMPLETED_FROM = _ANSWERED_FROM | {Status.ACKED, Status.RETRIED, Status.EXPIRED,
                                    Status.UNDELIVERABLE}
TRANSITIONS: dict[str, frozenset[str]] = {
    Status.PUBLISHED: frozenset({Status.SENT}),  # the broker's PUBACK
    Status.ACKED: _ANSWERED_FROM,
    # ... and a request to the console that the console refuses (RECV → NACKED).
    Status.NACKED: _ANSWERED_FROM | {Status.RECV},
    Status.BUSY: _ANSWERED_FROM,  # a BUSY answer, or a send refused at once
    Status.RETRYING: _ANSWERED_FROM,  # no ACK in time, or a retryable NACK
    Status.COMPLETED: _COMPLETED_FROM,
    Status.TASK_ERROR: _COMPLETED_FROM,
    Status.RETRIED: frozenset({Status.RETRYING}),  # a new attempt replaced it
    # The task's deadline, or the attempts, ran out; or no answer was seen on the bus for a
    # request between other nodes.
    Status.EXPIRED: OPEN_STATUSES | {Status.OBSERVED},
    # An operator's cancel: a late answer is recorded on its own row and changes nothing.
    Status.CANCELED: CANCELABLE_STATUSES,
    Status.FAILED: frozenset({Status.SENT}),  # never published
    Status.UNDELIVERABLE: frozenset({Status.SENT, Status.RETRYING}),
    Status.LOCAL_CONSUMED: frozenset({Status.SENT, Status.RECV}),
}



# The order in which one batch applies its changes, as the state machine runs: when a batch
# holds a request's ACK and its response, the ACK is applied first and the record keeps both.
APPLY_ORDER: dict[str, int] = {
    Status.PUBLISHED: 0, Status.ACKED: 1, Status.NACKED: 2, Status.BUSY: 2, Status.RETRYING: 3,
    Status.COMPLETED: 4, Status.TASK_ERROR: 4,
}
# A response arrived: the work was done (or reported its own failure), by a node.
RESPONDED_STATUSES = frozenset({Status.COMPLETED, Status.TASK_ERROR})


@dataclass(frozen=True, slots=True)
class Heard:
    """Where an answer came from: its headers.originNodeId ("" when absent), the node whose
    inbox it came on, and how the console heard it (RECV or OBSERVED)."""

    origin_node_id: str
    heard_on: str
    direction: str


@dataclass
class Change:
    """Move the message `message_id` (or `pk`) to `to`, if its status may go there
    (TRANSITIONS above) and is one of `allowed` when given (a narrower guard). Applied by
    messages.state.changes_apply, the only writer of statuses."""

    to: str
    reason: str
    actor: str
    allowed: frozenset[str] | None = None
    message_id: str | None = None
    pk: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    by: str = ""
    retryable: bool = False  # a NACK that allows another attempt
    # An answer heard on the bus: it moves the row only if it came from the right node on
    # the right inbox (Message.answer_refusal); otherwise it is refused, not skipped.
    heard: Heard | None = None

class Message(models.Model):
    """One transmission. A retry or a resend is a new row with a new message id."""

    message_id = models.CharField(max_length=200, unique=True)
    task_id = models.CharField(max_length=200, blank=True)
    idempotency_key = models.CharField(max_length=200, blank=True)
    message_type = models.CharField(max_length=16)
    direction = models.CharField(max_length=8, choices=Direction.choices)
    status = models.CharField(max_length=16, choices=Status.choices)
    from_agent_id = models.CharField(max_length=265, blank=True)
    to_agent_id = models.CharField(max_length=265, blank=True)
    target_node_id = models.CharField(max_length=128, blank=True)
    origin_node_id = models.CharField(max_length=128, blank=True)
    reply_node_id = models.CharField(max_length=128, blank=True)
    conversation_id = models.CharField(max_length=200, blank=True)
    scene_group_id = models.CharField(max_length=200, blank=True)
    session_id = models.CharField(max_length=200, blank=True)
    topic = models.CharField(max_length=300, blank=True)
    headers = models.JSONField(default=dict, blank=True)
    payload = models.JSONField(null=True, blank=True)
    # When the payload was dropped: content is kept only while a resend may need it
    # (REACH_PAYLOAD_KEEP_HOURS after the row's last change, messages/sweeps.payloads_drop);
    # the row's history, timing and outcome stay for the whole retention.
    payload_dropped_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True)
    # How the directory chose the target: level and the candidates it considered.
    resolution = models.JSONField(null=True, blank=True)
    attempt = models.PositiveIntegerField(default=1)
    # The message this one answers: inReplyTo of a response, ackFor of an ACK/NACK/BUSY.
    in_reply_to = models.CharField(max_length=200, blank=True)
    # No constraint in the database: a partitioned history drops a day's rows whole, and
    # the partition drop unlinks the resends that point into it (messages/partitions.py).
    resend_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="resends",
        db_constraint=False,
    )
    created_at = models.DateTimeField(default=timezone.now)
    published_at = models.DateTimeField(null=True, blank=True)
    acked_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # The task's own deadline (timeoutMs): no attempt is made past it, and no open row
    # outlives it.
    deadline_at = models.DateTimeField(null=True, blank=True)
    # The outbox: when a bridge should (next) publish this SENT row. A bridge that claims
    # it moves it a claim's length ahead, so a bridge that dies before the PUBACK leaves it
    # to be published again; null while held and once the broker took it.
    publish_at = models.DateTimeField(null=True, blank=True)
    # By when the receiver must acknowledge this transmission before it is tried again.
    ack_deadline_at = models.DateTimeField(null=True, blank=True)
    # When the next attempt of a RETRYING row is due.
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    # Kept back because its agent already has maxInflight unacknowledged messages.
    held = models.BooleanField(default=False)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "a2a_message"
        ordering = ["-created_at", "-id"]
        # Every index is one more entry on every row stored: each below names the query it
        # serves (measured with pg_stat_user_indexes, docs/performance.md), and none is a
        # `db_index` on a text column, which on PostgreSQL adds a `_like` twin no query reads.
        # Besides these: the primary key, the unique message id (the insert's ON CONFLICT),
        # the index of `resend_of` (a row's resends; the prune's ON DELETE SET NULL), and
        # `a2a_error_trgm` (the timeline's error search, migration 0005).
        indexes = [
            # The timeline, newest first, and the retention prune's oldest first.
            models.Index(fields=["created_at", "id"], name="a2a_timeline"),
            # The timeline's filters read these in its order, (created_at, id), to the page
            # size and no further (messages/selectors.py); an agent is walked as receiver
            # and as sender apart, never as one OR over the whole timeline.
            models.Index(fields=["status", "created_at", "id"], name="a2a_status_timeline"),
            models.Index(fields=["to_agent_id", "created_at", "id"],
                         name="a2a_to_agent_timeline"),
            models.Index(fields=["from_agent_id", "created_at", "id"],
                         name="a2a_from_agent_timeline"),
            # An agent's held work, released oldest first as its slots free, and the
            # recount of its open work (messages/backpressure.py).
            models.Index(fields=["to_agent_id", "held", "status"], name="a2a_agent_held_status"),
            # A task's attempts, its trace and the searches by task id (messages/selectors.py).
            models.Index(fields=["task_id", "created_at"], name="a2a_task_created"),
            # The timeline's conversation filter and search (messages/selectors.py).
            models.Index(fields=["conversation_id"], name="a2a_conversation"),
            # The answers to a request: its trace, and a response's release after its ACK
            # (messages/selectors.py, messages/outbox.py).
            models.Index(fields=["in_reply_to"], name="a2a_in_reply_to"),
            # Deadline indexes hold only the rows that can still be due, so a sweep costs
            # what is due, not what is stored.
            models.Index(fields=["publish_at"], name="a2a_outbox_due",
                         condition=Q(status="SENT", publish_at__isnull=False)),
            models.Index(fields=["ack_deadline_at"], name="a2a_ack_due",
                         condition=Q(status="PUBLISHED", ack_deadline_at__isnull=False)),
            models.Index(fields=["next_attempt_at"], name="a2a_retry_due",
                         condition=Q(status="RETRYING")),
            models.Index(fields=["deadline_at"], name="a2a_open_deadline",
                         condition=Q(status__in=["SENT", "PUBLISHED", "ACKED", "RETRYING",
                                                 "OBSERVED"],
                                     deadline_at__isnull=False)),
            # The content still kept (requests' and responses' payloads), oldest change first:
            # what the drop sweep walks holds only what it may drop, so its walk costs what
            # is kept for REACH_PAYLOAD_KEEP_HOURS, not the whole retention's ACKs.
            models.Index(fields=["updated_at"], name="a2a_payload_kept",
                         condition=Q(payload__isnull=False,
                                     message_type__in=["TASK_REQUEST", "TASK_RESPONSE"])),
        ]
        permissions = [("resend_message", "Can resend a message from the console"),
                       ("cancel_task", "Can cancel a task from the console")]

    def __str__(self) -> str:
        return f"{self.message_type} {self.message_id} {self.status}"

    def save(self, *args, **kwargs) -> None:
        # A new row on a partitioned history claims its message id in the key table first,
        # as the batch insert does (messages/state.py), and takes the primary key of its
        # time from the claim: one row per message id, in the partition of its created_at.
        if self._state.adding and self.pk is None:
            from messages.partitions import message_pk_claim

            self.pk = message_pk_claim(message_id=self.message_id, created_at=self.created_at)
        super().save(*args, **kwargs)

    @property
    def is_failure(self) -> bool:
        return self.status in FAILURE_STATUSES

    def answer_refusal(self, *, origin_node_id: str, heard_on: str, direction: str
                       ) -> tuple[str, str] | None:
        """Why an answer (ACK, NACK, BUSY, TASK_RESPONSE) may not move this request, as
        (code, words), or None when it may: it must come on the requester's own inbox, from
        the node the request was sent to (PROTOCOL.md "Message types"). A bus client cannot
        complete a task it never received.

        `origin_node_id` is the answer's headers.originNodeId ("" when absent), `heard_on`
        the node whose inbox it came on, `direction` how the console heard it."""
        if self.direction == Direction.RECV:
            return ("not_ours", "it answers a request the console received; only the "
                    "console answers those")
        if self.direction == Direction.SEND:
            if direction != Direction.RECV:
                return ("wrong_inbox", f"it came on {heard_on}'s inbox, not on the console's, "
                        "which sent the request")
        else:
            requester = self.reply_node_id or self.origin_node_id
            if heard_on != requester:
                return ("wrong_inbox", f"it came on {heard_on}'s inbox, not on that of "
                        f"{requester or 'the requester (the request named no reply node)'}")
        receiver = self.receiver_node_id
        if not origin_node_id:
            return ("no_origin", "it has no headers.originNodeId, so it cannot be told from "
                    f"an answer by another node than {receiver or 'the receiver'}")
        if origin_node_id != receiver:
            return ("wrong_node", f"it came from node {origin_node_id}, but the request was "
                    f"sent to {receiver or 'no node'}")
        return None

    @property
    def receiver_node_id(self) -> str:
        """The node a request went to: ours were routed there; one observed on the bus went
        to the node whose inbox it was seen on, whatever its targetNodeId claims."""
        if self.direction == Direction.OBSERVED:
            return inbox_node_of(self.topic) or self.target_node_id
        return self.target_node_id


class Transition(models.Model):
    """Every status change of a message: the raw material of its trace."""

    class Actor(models.TextChoices):
        API = "api", "the API"
        BRIDGE = "bridge", "the MQTT bridge"
        SWEEPER = "sweeper", "a sweeper"
        OPERATOR = "operator", "an operator"
        CONSOLE = "console", "the console"

    # No constraint in the database: a message's transitions live in the partition of the
    # same span as it (partitioned by message id) and are dropped with it.
    message = models.ForeignKey(Message, on_delete=models.CASCADE, related_name="transitions",
                                db_constraint=False)
    from_status = models.CharField(max_length=16, blank=True)
    to_status = models.CharField(max_length=16)
    at = models.DateTimeField(default=timezone.now)
    reason = models.TextField(blank=True)
    actor = models.CharField(max_length=16, choices=Actor.choices)
    by = models.CharField(max_length=150, blank=True, help_text="user or token, when a person")

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.from_status or '∅'} → {self.to_status}"


class MessageKey(models.Model):
    """The message ids stored, each once: the guard of "one row per message id" on a
    partitioned history, where a unique index must include the partition key and so cannot
    be on the message id alone. Narrow, unpartitioned, written in the insert's own statement
    (messages/state.py) and pruned with the rows it guards (messages/partitions.py).
    Unused on a history that is one table: its unique index on message_id does the same."""

    message_id = models.CharField(max_length=200, primary_key=True)
    # The row's primary key, which carries its time: what the key prune walks.
    message_pk = models.BigIntegerField(db_index=True)

    class Meta:
        db_table = "a2a_message_key"

    def __str__(self) -> str:
        return self.message_id


class AgentLoad(models.Model):
    """What the console has in flight and held for one agent: kept, not recounted.

    Changed in the same transaction as the message rows it counts (messages/backpressure.py) and
    reconciled against them by a sweep, so a send or a release reads one row instead of
    counting an agent's messages under a lock.
    """

    agent_id = models.CharField(max_length=265, unique=True)
    # Task requests sent to it and not yet answered (SENT and released, or PUBLISHED).
    inflight = models.IntegerField(default=0)
    # Task requests kept back behind its maxInflight (SENT, held).
    held = models.IntegerField(default=0)

    class Meta:
        db_table = "a2a_agent_load"

    def __str__(self) -> str:
        return f"{self.agent_id}: {self.inflight} in flight, {self.held} held"


class Task(models.Model):
    """One task as ops staff think of it: all transmissions of one `taskId` (retries,
    resends, reroutes) in one direction, with one outcome. Kept in the same transaction as
    the rows it sums (messages/ledger.py), so the task list is a keyset read however many
    attempts and answers its tasks had. A group send is a task per member (`member`)."""

    direction = models.CharField(max_length=8, choices=Direction.choices)
    task_id = models.CharField(max_length=200)
    # The group member this copy of a group send went to; "" for every other task.
    member = models.CharField(max_length=265, blank=True, default="")
    # The outcome: the status of its last attempt, or once answered COMPLETED / TASK_ERROR,
    # or CANCELED after a cancel.
    status = models.CharField(max_length=16, choices=Status.choices)
    to_agent_id = models.CharField(max_length=265, blank=True)
    from_agent_id = models.CharField(max_length=265, blank=True)
    target_node_id = models.CharField(max_length=128, blank=True)
    conversation_id = models.CharField(max_length=200, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    # When its first transmission was written (sent, or seen on the bus).
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True)
    # The node whose answer gave the outcome.
    answered_by = models.CharField(max_length=128, blank=True)
    last_message_id = models.CharField(max_length=200, blank=True)

    class Meta:
        db_table = "a2a_task"
        ordering = ["-created_at", "-id"]
        constraints = [
            # The upsert's key, task id first: it also finds every direction and member of
            # one task id (GET /api/a2a/tasks/{taskId}).
            models.UniqueConstraint(fields=["task_id", "direction", "member"],
                                    name="a2a_task_key"),
        ]
        indexes = [
            # The task list is the timeline's twin: each filter is read in its order,
            # (created_at, id), to the page size (messages/taskbook.py). An agent is walked
            # as receiver and as sender apart; a node, a namespace or a direction walks the
            # timeline (as the message timeline does): each index is paid on every write.
            models.Index(fields=["created_at", "id"], name="a2a_task_timeline"),
            models.Index(fields=["status", "created_at", "id"], name="a2a_task_status"),
            models.Index(fields=["to_agent_id", "created_at", "id"], name="a2a_task_to"),
            models.Index(fields=["from_agent_id", "created_at", "id"], name="a2a_task_from"),
        ]

    def __str__(self) -> str:
        return f"task {self.task_id} {self.status}"

    @property
    def duration_ms(self) -> int | None:
        if self.finished_at is None:
            return None
        return max(0, round((self.finished_at - self.created_at).total_seconds() * 1000))


class Rollup(models.Model):
    """A count added to one bucket of time for one subject: the numbers the overview, the
    stats and the alarms read (messages/rollups.py), kept as rows are written instead of
    counted from a window of rows.

    Rows are only ever inserted by writers (one per key and transaction, at the scope's
    finest width: no row is updated by two writers, so counting takes no lock and cannot
    deadlock) and folded by beat into one row per key at every width (`folded`). A reader
    sums whatever rows a key has, and the finest ones not folded yet."""

    step = models.PositiveIntegerField()  # the bucket's width in seconds
    bucket = models.BigIntegerField()  # epoch seconds // step
    scope = models.CharField(max_length=1)  # "*" the whole console, "a" an agent, "n" a node
    subject = models.CharField(max_length=265, blank=True)
    metric = models.CharField(max_length=32)
    n = models.BigIntegerField()
    folded = models.BooleanField(default=False)

    class Meta:
        db_table = "a2a_rollup"
        indexes = [
            # One subject's window: stats and the agent page.
            models.Index(fields=["step", "scope", "subject", "bucket"], name="a2a_rollup_subject"),
            # Every subject of a scope in a window (the roster's columns, the alarms) and
            # retention by age.
            models.Index(fields=["step", "scope", "bucket"], name="a2a_rollup_scope"),
            # What the fold has not folded yet: its claim, and a wider width's read of the
            # finest rows not yet added to it (messages/rollups.py `_kept`).
            models.Index(fields=["step", "scope", "subject", "bucket"],
                         name="a2a_rollup_unfolded", condition=Q(folded=False)),
        ]

    def __str__(self) -> str:
        return f"{self.scope}:{self.subject} {self.metric}@{self.bucket}×{self.step}s = {self.n}"
