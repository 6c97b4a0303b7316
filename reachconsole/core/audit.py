"""The audit trail: every operator and service action, whoever did it and how it ended.

A service writes its own row with `audit_record` inside the transaction of the change it
audits, so a change is never committed without its row, nor a row without its change.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class AuditEntry(models.Model):
    at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.CharField(max_length=150, help_text="user name, or source:token for a service")
    action = models.CharField(max_length=40)
    target = models.CharField(max_length=300)
    result = models.CharField(max_length=20, help_text="ok, refused or failed")
    detail = models.TextField(blank=True)

    class Meta:
        app_label = "core"
        # The table it had when the model lived in the `reachconsole` app: moving the model
        # kept its rows (core/migrations/0001_initial.py).
        db_table = "reachconsole_auditentry"
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"
        indexes = [models.Index(fields=["action", "at"], name="audit_action_at")]

    def __str__(self) -> str:
        when = f"{self.at:%Y-%m-%d %H:%M:%S}"
        return f"{when} {self.actor} {self.action} {self.target}: {self.result}"


def audit_record(*, actor: str, action: str, target: str, result: str = "ok",
                 detail: str = "") -> AuditEntry:
    """One audit row. Call it inside the transaction of the change it records."""
    return AuditEntry.objects.create(actor=actor[:150], action=action[:40], target=target[:300],
                                     result=result[:20], detail=detail)
