# The console's roles (reachconsole/core/roles.py): groups `viewer` and `operator` that exist
# after `migrate`. Running it again changes nothing (get_or_create, permissions.add); reversing
# it removes the two groups and nothing else.

from django.contrib.auth.management import create_permissions
from django.db import migrations

# A frozen copy of roles.py's lists: a migration must not change when the code does.
VIEWER = [
    ("core", "view_auditentry"),
    ("roster", "view_agent"),
    ("roster", "view_clusternode"),
    ("a2a", "view_message"),
]
OPERATOR = VIEWER + [
    ("a2a", "resend_message"),
    ("roster", "change_agent"),
    ("roster", "drain_agent"),
    ("roster", "reconcile_cluster"),
    ("roster", "manage_node"),
]


def _permissions(apps, db_alias, wanted):
    # Permissions are made by a post_migrate signal, after every migration has run: on a
    # fresh database they do not exist yet here, so make those of these apps now (the signal
    # later finds them and adds nothing).
    for label in {app for app, _ in wanted}:
        app_config = apps.get_app_config(label)
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


def roles_create(apps, schema_editor):
    db_alias = schema_editor.connection.alias
    Group = apps.get_model("auth", "Group")
    for name, wanted in (("viewer", VIEWER), ("operator", OPERATOR)):
        group, _ = Group.objects.using(db_alias).get_or_create(name=name)
        group.permissions.add(*_permissions(apps, db_alias, wanted))


def roles_remove(apps, schema_editor):
    Group = apps.get_model("auth", "Group")
    Group.objects.using(schema_editor.connection.alias).filter(
        name__in=["viewer", "operator"]).delete()


class Migration(migrations.Migration):

    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("core", "0001_initial"),
        ("roster", "0006_agent_status_heard"),
        ("a2a", "0004_agent_load"),
    ]

    operations = [
        migrations.RunPython(roles_create, roles_remove),
    ]
