from django.contrib import admin

from roster.models import Agent, ClusterNode, Namespace, RosterEvent


@admin.register(Namespace)
class NamespaceAdmin(admin.ModelAdmin):
    list_display = ["name", "description", "open_to_other_namespaces", "created_at"]
    list_filter = ["open_to_other_namespaces"]
    list_editable = ["open_to_other_namespaces"]
    search_fields = ["name", "description"]


@admin.register(ClusterNode)
class ClusterNodeAdmin(admin.ModelAdmin):
    list_display = ["node_id", "status", "retired", "last_seen_at", "heartbeat_ms", "url"]
    list_filter = ["status", "retired"]
    search_fields = ["node_id", "url"]
    readonly_fields = ["last_seen_at", "created_at"]


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    list_display = [
        "agent_id", "namespace", "node", "status", "lease_expires_at", "last_heartbeat_at",
        "inflight", "max_inflight", "version",
    ]
    list_filter = ["status", "namespace", "node"]
    search_fields = ["agent_id", "node__node_id", "owner", "endpoint"]
    list_select_related = ["namespace", "node"]
    date_hierarchy = "registered_at"
    # Lease, status and load belong to the roster's services (leases, drain, heartbeats):
    # the admin shows them but does not write them behind those services' backs.
    readonly_fields = [
        "agent_id", "namespace", "name", "segment", "node", "status", "lease_expires_at",
        "last_heartbeat_at", "drained_at", "expired_at", "inflight", "queue_depth",
        "registered_at", "updated_at",
    ]


@admin.register(RosterEvent)
class RosterEventAdmin(admin.ModelAdmin):
    list_display = ["at", "agent_id", "kind", "node_id", "actor", "detail"]
    list_filter = ["kind"]
    search_fields = ["agent_id", "node_id", "actor", "detail"]
    date_hierarchy = "at"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
