"""Alarms as records (PROTOCOL.md "Tasks, numbers and alarms"): each fires once per subject,
clears itself when its condition ends, and stays in the history. Written by
alarms/evaluate.py (beat) and alarms/services.py (acknowledge) only."""

from __future__ import annotations

from django.db import models
from django.utils import timezone

CONSOLE = "console"  # the subject of an alarm about the console as a whole


class Alarm(models.Model):
    class Kind(models.TextChoices):
        BUS_NOT_HEARD = "bus_not_heard", "the console does not hear the bus"
        NODE_DOWN = "node_down", "node down"
        CAPABILITY_UNCOVERED = "capability_uncovered", "capability without a routable agent"
        DELIVERY_FAILING = "delivery_failing", "deliveries failing"
        BROKER_DROPS = "broker_drops", "the broker dropped messages"
        TASKS_EXPIRING = "tasks_expiring", "tasks expiring"
        AGENT_FAILING = "agent_failing", "agent failing"
        RETENTION_BEHIND = "retention_behind", "history outgrowing its retention"

    class Severity(models.TextChoices):
        CRITICAL = "critical", "critical"
        WARNING = "warning", "warning"

    kind = models.CharField(max_length=32, choices=Kind.choices)
    # The node id, capability, agent id (up to 265 characters), or "console".
    subject = models.CharField(max_length=300)
    severity = models.CharField(max_length=8, choices=Severity.choices)
    detail = models.TextField(help_text="what holds, in words an operator can act on")
    fired_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    # Null while the condition holds: the partial unique constraint below is on these rows.
    cleared_at = models.DateTimeField(null=True, blank=True)
    acknowledged_by = models.CharField(max_length=150, blank=True)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    ack_note = models.TextField(blank=True)
    # One root cause, one alarm: the capabilities and agents a down node takes with it are
    # its children. DO_NOTHING: the retention prune unlinks children set-wise first and then
    # deletes in one statement (Django's SET_NULL would load every row it deletes).
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.DO_NOTHING,
                               related_name="children")

    class Meta:
        db_table = "alarms_alarm"
        ordering = ["-fired_at", "-id"]
        constraints = [
            # Fires once per subject: two evaluations at once cannot both insert it (the
            # second's insert meets this index and gets the first's row instead).
            models.UniqueConstraint(fields=["kind", "subject"], name="alarm_active_once",
                                    condition=models.Q(cleared_at__isnull=True)),
        ]
        indexes = [
            # The active list (the page, the overview's strip, the header's count): a few
            # rows, however long the history.
            models.Index(fields=["-fired_at", "-id"], name="alarm_active_newest",
                         condition=models.Q(cleared_at__isnull=True)),
            # The history, newest first, keyset paged; and the retention prune by age.
            models.Index(fields=["-fired_at", "-id"], name="alarm_history"),
        ]
        permissions = [("acknowledge_alarm", "Can acknowledge alarms")]

    def __str__(self) -> str:
        return f"{self.kind} {self.subject}"

    @property
    def active(self) -> bool:
        return self.cleared_at is None

    @property
    def acknowledged(self) -> bool:
        return self.acknowledged_at is not None
