# The audit trail moved from the `reachconsole` app into the kernel. Its table stays where it
# is (reachconsole.0001 created it); this migration only tells Django's state that `core`
# owns it now, and reachconsole.0002 lets go of it. No table is created or dropped.

import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ("reachconsole", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='AuditEntry',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('at', models.DateTimeField(db_index=True, default=django.utils.timezone.now)),
                        ('actor', models.CharField(help_text='user name, or source:token for a service', max_length=150)),
                        ('action', models.CharField(max_length=40)),
                        ('target', models.CharField(max_length=300)),
                        ('result', models.CharField(help_text='ok, refused or failed', max_length=20)),
                        ('detail', models.TextField(blank=True)),
                    ],
                    options={
                        'verbose_name_plural': 'audit entries',
                        'db_table': 'reachconsole_auditentry',
                        'ordering': ['-at', '-id'],
                        'indexes': [models.Index(fields=['action', 'at'], name='audit_action_at')],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
