# The audit trail moved to the kernel app `core` (core.0001 took over the table in Django's
# state). Here the `reachconsole` app lets go of the model in state only: the table and its
# rows stay. The model's content type follows it, so permissions given on the audit trail
# (a group that may view it) are kept rather than left on a stale content type.

from django.db import migrations


def content_type_to_core(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    db = schema_editor.connection.alias
    if ContentType.objects.using(db).filter(app_label="core", model="auditentry").exists():
        return
    ContentType.objects.using(db).filter(app_label="reachconsole", model="auditentry").update(
        app_label="core"
    )


def content_type_to_reachconsole(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    db = schema_editor.connection.alias
    if ContentType.objects.using(db).filter(app_label="reachconsole", model="auditentry").exists():
        return
    ContentType.objects.using(db).filter(app_label="core", model="auditentry").update(
        app_label="reachconsole"
    )


class Migration(migrations.Migration):

    dependencies = [
        ("reachconsole", "0001_initial"),
        ("core", "0001_initial"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="AuditEntry")],
            database_operations=[],
        ),
        migrations.RunPython(content_type_to_core, content_type_to_reachconsole),
    ]
