from django import forms
from django.contrib import admin, messages

from directory import aliases
from directory.errors import ALIAS_NOT_REGISTERED, DirectoryError
from directory.models import Alias, ProcessDefinitionBinding, ProcessInstance, SceneBinding
from reachconsole.core.errors import ConsoleError


class AliasForm(forms.ModelForm):
    """The namespace is not asked for: it can only be the agent's, and follows its id."""

    class Meta:
        model = Alias
        fields = ["alias", "agent_id"]

    # Which field a refusal belongs to, by its code; the rest go on the alias.
    FIELD_OF = {"invalid_agent_id": "agent_id", "alias_no_namespace": "agent_id"}

    def clean(self) -> dict:
        cleaned = super().clean()
        # Not Meta.fields: the admin's own form class lists the read-only namespace there too.
        if any(cleaned.get(key) in (None, "") for key in ("alias", "agent_id")):
            return cleaned  # a missing field has its own error already
        try:
            checked = aliases.alias_check(
                alias=cleaned["alias"], agent_id=cleaned["agent_id"], alias_id=self.instance.pk,
            )
        except ConsoleError as exc:
            self.add_error(self.FIELD_OF.get(exc.code, "alias"),
                           forms.ValidationError(exc.detail, code=exc.code))
            return cleaned
        cleaned.update(alias=checked.alias, agent_id=checked.agent_id)
        return cleaned


@admin.register(Alias)
class AliasAdmin(admin.ModelAdmin):
    """Every save and delete goes through directory/aliases.py: the same checks as anywhere
    else, and an audit row with the staff member as the actor."""

    form = AliasForm
    list_display = ["alias", "agent_id", "namespace", "created_at"]
    list_filter = ["namespace"]
    search_fields = ["alias", "agent_id"]
    list_select_related = ["namespace"]

    readonly_fields = ["namespace"]

    def save_model(self, request, obj, form, change) -> None:
        data, actor = form.cleaned_data, request.user.get_username()
        if change:
            saved, fields = aliases.alias_update(alias_id=obj.pk, alias=data["alias"],
                                                 agent_id=data["agent_id"], actor=actor)
        else:
            saved, fields = aliases.alias_create(alias=data["alias"],
                                                 agent_id=data["agent_id"], actor=actor)
            # The admin goes on with `obj` (its history, the redirect): the stored row.
            obj.pk, obj.created_at, obj._state.adding = saved.pk, saved.created_at, False
        obj.namespace = saved.namespace
        if not fields.registered:
            self.message_user(request, ALIAS_NOT_REGISTERED.format(
                agent_id=fields.agent_id, alias=fields.alias), messages.WARNING)

    def delete_model(self, request, obj) -> None:
        aliases.alias_delete(alias_id=obj.pk, actor=request.user.get_username())

    def delete_queryset(self, request, queryset) -> None:
        for alias_id in queryset.order_by("pk").values_list("pk", flat=True):
            try:
                aliases.alias_delete(alias_id=alias_id, actor=request.user.get_username())
            except DirectoryError as exc:  # removed meanwhile by another operator
                messages.warning(request, exc.detail)


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
