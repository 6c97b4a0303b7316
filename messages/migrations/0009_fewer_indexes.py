"""Fewer indexes on a2a_message: seven that no query reads, each a cost on every row stored.

- `idempotency_key`: the idempotency window is kept in the cache (messages/idempotency.py);
  no query of the table filters on the key. Both its indexes go.
- `task_id`: every query by task reads (task_id, created_at), `a2a_task_created`, which
  serves a lookup by task alone as well. Both its single-column indexes go.
- The `_like` twins (varchar_pattern_ops) that Django adds on PostgreSQL for `db_index` and
  `unique` text columns, of `message_id`, `conversation_id` and `in_reply_to`: only a
  `LIKE 'x%'` reads them, and no query runs one on these columns.

`conversation_id` and `in_reply_to` keep their plain index under a name of ours (declared in
the model's Meta, so the model no longer asks for the `_like` twin). Done in place: indexes
dropped and renamed, none built, so the migration takes a moment at any size (a rename
takes a brief exclusive lock on the table). Reversed, it builds them again.
"""

from django.db import migrations, models

# (column, keeps its plain index under this name, or drops it)
COLUMNS = (
    ("idempotency_key", None),
    ("task_id", None),
    ("conversation_id", "a2a_conversation"),
    ("in_reply_to", "a2a_in_reply_to"),
)
TABLE = "a2a_message"


def _name(schema_editor, column, suffix=""):
    # Django's own rule for the names it gave these indexes (db_index=True, unique=True).
    return schema_editor._create_index_name(TABLE, [column], suffix=suffix)


def indexes_drop(apps, schema_editor):
    qn = schema_editor.quote_name
    postgres = schema_editor.connection.vendor == "postgresql"
    for column, keep_as in COLUMNS:
        if postgres:
            schema_editor.execute(f"DROP INDEX IF EXISTS {qn(_name(schema_editor, column, '_like'))}")
        plain = qn(_name(schema_editor, column))
        if keep_as is None:
            schema_editor.execute(f"DROP INDEX IF EXISTS {plain}")
        elif postgres:
            schema_editor.execute(f"ALTER INDEX {plain} RENAME TO {qn(keep_as)}")
        else:  # SQLite cannot rename an index; the embedded database is small
            schema_editor.execute(f"DROP INDEX IF EXISTS {plain}")
            schema_editor.execute(f"CREATE INDEX {qn(keep_as)} ON {qn(TABLE)} ({qn(column)})")
    if postgres:
        schema_editor.execute(
            f"DROP INDEX IF EXISTS {qn(_name(schema_editor, 'message_id', '_like'))}")


def indexes_build(apps, schema_editor):
    qn = schema_editor.quote_name
    postgres = schema_editor.connection.vendor == "postgresql"
    for column, keep_as in COLUMNS:
        plain = qn(_name(schema_editor, column))
        if keep_as is not None and postgres:
            schema_editor.execute(f"ALTER INDEX {qn(keep_as)} RENAME TO {plain}")
        else:
            if keep_as is not None:
                schema_editor.execute(f"DROP INDEX IF EXISTS {qn(keep_as)}")
            schema_editor.execute(f"CREATE INDEX {plain} ON {qn(TABLE)} ({qn(column)})")
        if postgres:
            schema_editor.execute(
                f"CREATE INDEX {qn(_name(schema_editor, column, '_like'))} ON {qn(TABLE)} "
                f"({qn(column)} varchar_pattern_ops)")
    if postgres:
        schema_editor.execute(
            f"CREATE INDEX {qn(_name(schema_editor, 'message_id', '_like'))} ON {qn(TABLE)} "
            f"({qn('message_id')} varchar_pattern_ops)")


class Migration(migrations.Migration):

    dependencies = [
        ("a2a", "0008_rollups_finest_only"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(indexes_drop, indexes_build)],
            state_operations=[
                migrations.AlterField(
                    model_name="message", name="idempotency_key",
                    field=models.CharField(blank=True, max_length=200)),
                migrations.AlterField(
                    model_name="message", name="task_id",
                    field=models.CharField(blank=True, max_length=200)),
                migrations.AlterField(
                    model_name="message", name="conversation_id",
                    field=models.CharField(blank=True, max_length=200)),
                migrations.AlterField(
                    model_name="message", name="in_reply_to",
                    field=models.CharField(blank=True, max_length=200)),
                migrations.AddIndex(
                    model_name="message",
                    index=models.Index(fields=["conversation_id"], name="a2a_conversation")),
                migrations.AddIndex(
                    model_name="message",
                    index=models.Index(fields=["in_reply_to"], name="a2a_in_reply_to")),
            ],
        ),
    ]
