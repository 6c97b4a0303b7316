from django.contrib import admin

from reachconsole.core.audit import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = ["at", "actor", "action", "target", "result", "detail"]
    list_filter = ["action", "result"]
    search_fields = ["actor", "target", "detail"]
    date_hierarchy = "at"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
