# The permission `roster.drain_agent` goes: nothing ever asked for it (draining, undraining
# and deregistering one agent take `roster.change_agent`, reachconsole/core/roles.py), and a
# permission nobody checks only misleads whoever grants it. Django does not delete a
# permission when a model's Meta stops naming it, so this does, which also takes it from
# every group and user that held it. Reversing it gives it back to the operator group.

from django.contrib.auth.management import create_permissions
from django.db import migrations


def drain_permission_drop(apps, schema_editor):
    Permission = apps.get_model("auth", "Permission")
    Permission.objects.using(schema_editor.connection.alias).filter(
        content_type__app_label="roster", codename="drain_agent").delete()


def drain_permission_restore(apps, schema_editor):
    db_alias = schema_editor.connection.alias
    # The models as this migration's predecessor sees them still name it: made again here.
    app_config = apps.get_app_config("roster")
    app_config.models_module = True
    create_permissions(app_config, verbosity=0, using=db_alias, apps=apps)
    app_config.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for group in Group.objects.using(db_alias).filter(name="operator"):
        group.permissions.add(*Permission.objects.using(db_alias).filter(
            content_type__app_label="roster", codename="drain_agent"))


class Migration(migrations.Migration):

    dependencies = [
        ("roster", "0010_node_signing"),
        ("core", "0002_roles"),  # which granted it to the operator group
    ]

    operations = [
        migrations.RunPython(drain_permission_drop, drain_permission_restore),
        migrations.AlterModelOptions(
            name="agent",
            options={"ordering": ["agent_id"]},
        ),
    ]
