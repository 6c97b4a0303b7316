"""Content is not history: `payload_dropped_at`, when a message's payload was dropped.

A nullable column without a default: a catalog change on PostgreSQL, instant at any size.
The index the drop sweep reads is built by 0011, apart, because a concurrent build cannot run
in a transaction and a failed one must be retried without this step.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("a2a", "0009_fewer_indexes"),
    ]

    operations = [
        migrations.AddField(
            model_name="message",
            name="payload_dropped_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
