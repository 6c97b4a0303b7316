# The console's identity (reachconsole/core/identity.py): one row, written here with the
# name the database's address gave before identities were rows, so an upgraded console keeps
# its broker sessions and Redis keys. Reversing it drops the table.

import hashlib

from django.db import migrations, models


def identity_write(apps, schema_editor):
    # A frozen copy of identity.address_identity: a migration must not change when code does.
    db = schema_editor.connection.settings_dict
    where = f"{db.get('HOST') or ''}:{db.get('PORT') or ''}/{db.get('NAME')}"
    name = "reach-" + hashlib.sha256(where.encode()).hexdigest()[:12]
    apps.get_model("core", "ConsoleIdentity").objects.get_or_create(
        pk=1, defaults={"name": name})


class Migration(migrations.Migration):

    dependencies = [
        ('core', '0002_roles'),
    ]

    operations = [
        migrations.CreateModel(
            name='ConsoleIdentity',
            fields=[
                ('id', models.PositiveSmallIntegerField(default=1, primary_key=True, serialize=False)),
                ('name', models.CharField(max_length=40)),
                ('created_at', models.DateTimeField(auto_now_add=True)),
            ],
            options={
                'verbose_name_plural': 'console identity',
                'db_table': 'reach_console_identity',
            },
        ),
        migrations.RunPython(identity_write, migrations.RunPython.noop),
    ]
