"""Names that the directory turns into agents. Only the directory reads these to resolve."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class Alias(models.Model):
    alias = models.CharField(max_length=200, help_text="What people type, e.g. @资金日报 or tax")
    agent_id = models.CharField(max_length=265, db_index=True, help_text="e.g. fin.bank-statement")
    namespace = models.ForeignKey(
        "roster.Namespace", on_delete=models.CASCADE, related_name="aliases"
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["namespace__name", "alias"]
        verbose_name_plural = "aliases"
        constraints = [
            models.UniqueConstraint(fields=["namespace", "alias"], name="alias_unique_in_namespace")
        ]

    def __str__(self) -> str:
        return f"{self.alias} → {self.agent_id}"
