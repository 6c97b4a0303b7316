# The alarms' part of the console's roles (reachconsole/core/roles.py): a viewer sees them,
# an operator also acknowledges them. Running it again changes nothing (get_or_create,
# permissions.add); reversing it takes these permissions from the two groups, nothing else.

from django.contrib.auth.management import create_permissions
from django.db import migrations

# A frozen copy of roles.py's lists (the alarms' entries): a migration must not change when
# the code does.
VIEWER = [("alarms", "view_alarm")]
OPERATOR = VIEWER + [("alarms", "acknowledge_alarm")]


def _permissions(apps, db_alias, wanted):
    # Permissions are made by a post_migrate signal, after every migration has run: on a
    # fresh database they do not exist yet here, so make this app's now (the signal later
    # finds them and adds nothing).
    app_config = apps.get_app_config("alarms")
    app_config.models_module = True
    create_permissions(app_config, verbosity=0, using=db_alias, apps=apps)
    app_config.models_module = None
    Permission = apps.get_model("auth", "Permission")
    found = []
    for app_label, codename in wanted:
        permission = Permission.objects.using(db_alias).filter(
            content_type__app_label=app_label, codename=codename).first()
        if permission is None:
            raise RuntimeError(f"permission {app_label}.{codename} does not exist: the role "
                               "lists in this migration name a model or codename that is gone")
        found.append(permission)
    return found


def roles_grant(apps, schema_editor):
    db_alias = schema_editor.connection.alias
    Group = apps.get_model("auth", "Group")
    for name, wanted in (("viewer", VIEWER), ("operator", OPERATOR)):
        group, _ = Group.objects.using(db_alias).get_or_create(name=name)
        group.permissions.add(*_permissions(apps, db_alias, wanted))


def roles_revoke(apps, schema_editor):
    db_alias = schema_editor.connection.alias
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    ours = Permission.objects.using(db_alias).filter(content_type__app_label="alarms")
    for group in Group.objects.using(db_alias).filter(name__in=["viewer", "operator"]):
        group.permissions.remove(*ours)


class Migration(migrations.Migration):

    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("core", "0002_roles"),
        ("alarms", "0001_initial"),
    ]

    operations = [
        migrations.RunPython(roles_grant, roles_revoke),
    ]
