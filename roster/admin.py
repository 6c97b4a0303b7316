from django import forms
from django.contrib import admin, messages

from reachconsole.core.errors import ConsoleError
from roster import services
from roster.errors import RosterError
from roster.models import Agent, ClusterNode, Namespace, RosterEvent
from roster.namespaces import (
    namespace_create,
    namespace_delete,
    namespace_name_check,
    namespace_update,
)


class NamespaceForm(forms.ModelForm):
    class Meta:
        model = Namespace
        fields = ["name", "description", "open_to_other_namespaces"]

    def clean_name(self) -> str:
        # Only on add: a namespace's name is read-only once it exists (agent ids begin with it).
        try:
            return namespace_name_check(self.cleaned_data.get("name"))
        except ConsoleError as exc:
            raise forms.ValidationError(exc.detail, code=exc.code) from None


@admin.register(Namespace)
class NamespaceAdmin(admin.ModelAdmin):
    """Every save, list edit, action and delete goes through roster/namespaces.py: the same
    checks as anywhere else, and an audit row with the staff member as the actor."""

    form = NamespaceForm
    list_display = ["name", "description", "open_to_other_namespaces", "created_at"]
    list_filter = ["open_to_other_namespaces"]
    list_editable = ["open_to_other_namespaces"]
    search_fields = ["name", "description"]
    actions = ["open_selected", "close_selected"]

    def get_readonly_fields(self, request, obj=None):
        return ["name", "created_at"] if obj is not None else []

    def save_model(self, request, obj, form, change) -> None:
        actor = request.user.get_username()
        data = form.cleaned_data
        if change:
            namespace_update(
                name=obj.name, actor=actor, description=data.get("description"),
                open_to_other_namespaces=data.get("open_to_other_namespaces"),
            )
            return
        created = namespace_create(
            name=data["name"], description=data.get("description", ""),
            open_to_other_namespaces=data.get("open_to_other_namespaces", False), actor=actor,
        )
        # The admin goes on with `obj` (its history, the redirect): make it the stored row.
        obj.pk, obj.created_at, obj._state.adding = created.pk, created.created_at, False

    def delete_model(self, request, obj) -> None:
        namespace_delete(name=obj.name, actor=request.user.get_username())

    def delete_queryset(self, request, queryset) -> None:
        self._each(request, queryset, namespace_delete)

    def _set_open(self, request, queryset, value: bool) -> None:
        self._each(request, queryset, namespace_update, open_to_other_namespaces=value)

    def _each(self, request, queryset, service, **changes) -> None:
        actor = request.user.get_username()
        for name in queryset.order_by("name").values_list("name", flat=True):
            try:
                service(name=name, actor=actor, **changes)
            except RosterError as exc:  # removed meanwhile by another operator
                messages.warning(request, exc.detail)

    @admin.action(description="Open the selected namespaces to other namespaces",
                  permissions=["change"])
    def open_selected(self, request, queryset) -> None:
        self._set_open(request, queryset, True)

    @admin.action(description="Close the selected namespaces to other namespaces",
                  permissions=["change"])
    def close_selected(self, request, queryset) -> None:
        self._set_open(request, queryset, False)


@admin.register(ClusterNode)
class ClusterNodeAdmin(admin.ModelAdmin):
    list_display = ["node_id", "status", "retired", "last_seen_at", "heartbeat_ms", "url"]
    list_filter = ["status", "retired"]
    search_fields = ["node_id", "url"]
    readonly_fields = ["last_seen_at", "created_at"]


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    """Read-only: an agent's identity, capabilities, groups, metadata, maxInflight, node,
    owner and lease come from its registration and heartbeats (roster/services.py), with
    their checks and history rows; the admin shows them and never writes them. Removing
    one here is a deregistration, audited like one."""

    list_display = [
        "agent_id", "namespace", "node", "status", "lease_expires_at", "last_heartbeat_at",
        "inflight", "max_inflight", "version",
    ]
    list_filter = ["status", "namespace", "node"]
    search_fields = ["agent_id", "node__node_id", "owner", "endpoint"]
    list_select_related = ["namespace", "node"]
    date_hierarchy = "registered_at"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def delete_model(self, request, obj) -> None:
        self._deregister(request, [obj.agent_id])

    def delete_queryset(self, request, queryset) -> None:
        self._deregister(request, queryset.order_by("agent_id").values_list("agent_id",
                                                                            flat=True))

    def _deregister(self, request, agent_ids) -> None:
        actor = request.user.get_username()
        for agent_id in agent_ids:
            try:
                services.agent_deregister(agent_id=agent_id, actor=actor)
            except RosterError as exc:  # gone meanwhile (the lease sweeper, another operator)
                messages.warning(request, exc.detail)


@admin.register(RosterEvent)
class RosterEventAdmin(admin.ModelAdmin):
    list_display = ["at", "agent_id", "kind", "node_id", "actor", "detail"]
    list_filter = ["kind"]
    search_fields = ["agent_id", "node_id", "actor", "detail"]
    date_hierarchy = "at"
    # Newest written first, read backwards off the primary key: `at` has only a BRIN index
    # (migration 0008), which finds time ranges but cannot order a history of millions.
    ordering = ["-id"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
