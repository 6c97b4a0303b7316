from django.contrib import admin

from directory.models import Alias


@admin.register(Alias)
class AliasAdmin(admin.ModelAdmin):
    list_display = ["alias", "agent_id", "namespace", "created_at"]
    list_filter = ["namespace"]
    search_fields = ["alias", "agent_id"]
    list_select_related = ["namespace"]
