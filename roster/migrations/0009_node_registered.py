from django.db import migrations, models


def never_heard_registered(apps, schema_editor):
    """A node that was ONLINE without ever being heard is what REGISTERED now says."""
    apps.get_model("roster", "ClusterNode").objects.filter(
        status="ONLINE", last_seen_at__isnull=True).update(status="REGISTERED")


class Migration(migrations.Migration):

    dependencies = [
        ('roster', '0008_lease_deadlines'),
    ]

    operations = [
        migrations.AlterField(
            model_name='clusternode',
            name='status',
            field=models.CharField(choices=[('REGISTERED', 'registered, never heard'), ('ONLINE', 'online'), ('DOWN', 'down')], default='REGISTERED', max_length=16),
        ),
        migrations.RunPython(never_heard_registered, migrations.RunPython.noop),
    ]
