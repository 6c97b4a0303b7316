# The name column held 200 characters while the agent id rule allows a 263-character name
# (a one-letter namespace): such a registration failed on PostgreSQL.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("roster", "0004_cluster_reconciliation"),
    ]

    operations = [
        migrations.AlterField(
            model_name="agent",
            name="name",
            field=models.CharField(max_length=265),
        ),
    ]
