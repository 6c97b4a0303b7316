"""The lease sweep's own queue (LeaseDeadline), and the indexes that let its update of a
lapsed agent be HOT: none on roster_agent mentions status, and the table keeps 55 % of each
page free for the new row versions. A history row writes two btree entries (its key and
the agent's history), where it wrote four."""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


def storage_set(apps, schema_editor):
    """Storage settings the model cannot say. Existing pages keep their packing until they
    are rewritten (VACUUM FULL roster_agent does it at once, under an exclusive lock)."""
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE roster_agent SET (fillfactor = 45)")
        schema_editor.execute(
            "CREATE INDEX rosterevent_at ON roster_rosterevent USING brin (at)")
    else:
        schema_editor.execute("CREATE INDEX rosterevent_at ON roster_rosterevent (at)")


def storage_reset(apps, schema_editor):
    schema_editor.execute("DROP INDEX IF EXISTS rosterevent_at")
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("ALTER TABLE roster_agent RESET (fillfactor)")


def deadlines_fill(apps, schema_editor):
    """Every live agent gets its deadline: its lease's end."""
    Agent = apps.get_model("roster", "Agent")
    LeaseDeadline = apps.get_model("roster", "LeaseDeadline")
    live = Agent.objects.filter(status__in=["ONLINE", "DRAINING"]).values_list(
        "pk", "lease_expires_at").order_by("pk")
    LeaseDeadline.objects.bulk_create(
        (LeaseDeadline(agent_id=pk, expires_at=at) for pk, at in live.iterator(chunk_size=5000)),
        batch_size=5000)


class Migration(migrations.Migration):

    dependencies = [
        ('roster', '0007_lean_lease_indexes'),
    ]

    operations = [
        migrations.CreateModel(
            name='LeaseDeadline',
            fields=[
                ('agent', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True, related_name='lease_deadline', serialize=False, to='roster.agent')),
                ('expires_at', models.DateTimeField(db_index=True)),
            ],
        ),
        migrations.RemoveIndex(
            model_name='agent',
            name='agent_status_heard',
        ),
        migrations.RemoveIndex(
            model_name='agent',
            name='agent_lease_live',
        ),
        migrations.RemoveIndex(
            model_name='rosterevent',
            name='rosterevent_kind_at',
        ),
        migrations.AlterField(
            model_name='rosterevent',
            name='at',
            field=models.DateTimeField(default=django.utils.timezone.now),
        ),
        migrations.AddIndex(
            model_name='rosterevent',
            index=models.Index(condition=models.Q(('kind', 'CONFLICT')), fields=['at'], name='rosterevent_conflict_at'),
        ),
        migrations.RunPython(storage_set, storage_reset),
        migrations.RunPython(deadlines_fill, migrations.RunPython.noop),
    ]
