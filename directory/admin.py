from django.contrib import admin

from directory.models import Alias, ProcessDefinitionBinding, ProcessInstance, SceneBinding


@admin.register(Alias)
class AliasAdmin(admin.ModelAdmin):
    list_display = ["alias", "agent_id", "namespace", "created_at"]
    list_filter = ["namespace"]
    search_fields = ["alias", "agent_id"]
    list_select_related = ["namespace"]


@admin.register(SceneBinding)
class SceneBindingAdmin(admin.ModelAdmin):
    list_display = ["scene_id", "agent_id", "note", "created_at"]
    search_fields = ["scene_id", "agent_id", "note"]


@admin.register(ProcessDefinitionBinding)
class ProcessDefinitionBindingAdmin(admin.ModelAdmin):
    list_display = ["definition_id", "agent_id", "note", "created_at"]
    search_fields = ["definition_id", "agent_id", "note"]


@admin.register(ProcessInstance)
class ProcessInstanceAdmin(admin.ModelAdmin):
    list_display = ["pid", "definition_id", "created_at"]
    search_fields = ["pid", "definition_id"]
