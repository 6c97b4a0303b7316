"""Names that the directory turns into agents. Only the directory reads these to resolve."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


def alias_normalize(text: str) -> str:
    return text.strip().lstrip("@").strip()


class Alias(models.Model):
    alias = models.CharField(max_length=200, db_index=True,
                             help_text="What people type, e.g. 资金日报 (a leading @ is ignored)")
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

    def clean(self) -> None:
        # Kept without the @ so `@资金日报` and `资金日报` are one alias.
        self.alias = alias_normalize(self.alias)


class SceneBinding(models.Model):
    """A scene is served by one agent."""

    scene_id = models.CharField(max_length=200, unique=True)
    agent_id = models.CharField(max_length=265, db_index=True)
    note = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["scene_id"]

    def __str__(self) -> str:
        return f"scene {self.scene_id} → {self.agent_id}"


class ProcessDefinitionBinding(models.Model):
    """Every process instance of a definition is served by one agent."""

    definition_id = models.CharField(max_length=200, unique=True)
    agent_id = models.CharField(max_length=265, db_index=True)
    note = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["definition_id"]

    def __str__(self) -> str:
        return f"definition {self.definition_id} → {self.agent_id}"


class ProcessInstance(models.Model):
    """Which definition a process instance (pid) runs."""

    pid = models.CharField(max_length=200, unique=True)
    definition_id = models.CharField(max_length=200, db_index=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["pid"]

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.definition_id})"
