# Operators may cancel tasks (reachconsole/core/roles.py): the permission `a2a.cancel_task`
# (messages.models.Message's Meta) joins the operator group. Running it again changes
# nothing; reversing it takes the permission away from the group only.

from django.contrib.auth.management import create_permissions
from django.db import migrations


def _cancel_permission(apps, db_alias):
    # Permissions are made after every migration has run (post_migrate): make this app's now.
    app_config = apps.get_app_config("a2a")
    app_config.models_module = True
    create_permissions(app_config, verbosity=0, using=db_alias, apps=apps)
    app_config.models_module = None
    Permission = apps.get_model("auth", "Permission")
    return Permission.objects.using(db_alias).get(content_type__app_label="a2a",
                                                  codename="cancel_task")


def operators_may_cancel(apps, schema_editor):
    db_alias = schema_editor.connection.alias
    Group = apps.get_model("auth", "Group")
    group, _ = Group.objects.using(db_alias).get_or_create(name="operator")
    group.permissions.add(_cancel_permission(apps, db_alias))


def operators_may_not_cancel(apps, schema_editor):
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    db_alias = schema_editor.connection.alias
    for group in Group.objects.using(db_alias).filter(name="operator"):
        group.permissions.remove(*Permission.objects.using(db_alias).filter(
            content_type__app_label="a2a", codename="cancel_task"))


class Migration(migrations.Migration):

    dependencies = [
        ("a2a", "0006_tasks_rollups"),
        ("core", "0002_roles"),
        ("auth", "0012_alter_user_first_name_max_length"),
    ]

    operations = [
        migrations.RunPython(operators_may_cancel, operators_may_not_cancel),
    ]
