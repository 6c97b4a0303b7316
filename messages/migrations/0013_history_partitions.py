"""The history partitioned by time on PostgreSQL (messages/partitions.py).

In place and in one transaction: each table becomes the first partition of a partitioned
table of the same name (no row moves), the message ids are copied into their key table,
and the current span's partitions and those ahead are made. Writers wait for the locks
meanwhile: measured at 1,000,000 messages in docs/scaling.md, "Moving an existing history".

Skipped on SQLite and with REACH_PARTITIONS=off: the history stays one table, pruned by
batched deletes. Reversed, every row is copied back into one table each.
"""

from django.conf import settings
from django.db import migrations
from django.utils import timezone


def forwards(apps, schema_editor):
    from messages import partitions

    if schema_editor.connection.vendor != "postgresql" or not settings.REACH_PARTITIONS:
        return
    partitions.partitioned_forget()
    with schema_editor.connection.cursor() as cursor:
        partitions.history_partition(cursor, now=timezone.now())
    partitions.partitioned_forget()


def backwards(apps, schema_editor):
    from messages import partitions

    partitions.partitioned_forget()
    if not partitions.history_partitioned():
        return
    with schema_editor.connection.cursor() as cursor:
        partitions.history_unpartition(cursor)
    partitions.partitioned_forget()


class Migration(migrations.Migration):
    dependencies = [
        ("a2a", "0012_partition_ready"),
    ]

    operations = [
        migrations.RunPython(forwards, backwards, elidable=False),
    ]
