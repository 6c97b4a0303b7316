"""Content is not history: `payload_dropped_at`, and the partial index the drop sweep reads.

Online on PostgreSQL: the column is nullable without a default (a catalog change), and the
index is built CONCURRENTLY, so writes go on while it builds (measured at 1,000,000 rows in
docs/performance.md). A concurrent build cannot run in a transaction, so this migration is
not atomic; a build that failed leaves an INVALID index, which `IF NOT EXISTS` would keep, so
a rerun drops it first. Other databases build it the ordinary way.
"""

from django.db import migrations, models

INDEX = models.Index(condition=models.Q(("payload__isnull", False)), fields=["updated_at"],
                     name="a2a_payload_kept")


class AddIndexOnline(migrations.AddIndex):
    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            return super().database_forwards(app_label, schema_editor, from_state, to_state)
        model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(
                "SELECT NOT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                " WHERE c.relname = %s", [self.index.name])
            found = cursor.fetchone()
        if found and found[0]:
            schema_editor.execute(f"DROP INDEX CONCURRENTLY {self.index.name}")
        elif found:
            return
        schema_editor.add_index(model, self.index, concurrently=True)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            return super().database_backwards(app_label, schema_editor, from_state, to_state)
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {self.index.name}")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("a2a", "0009_fewer_indexes"),
    ]

    operations = [
        migrations.AddField(
            model_name="message",
            name="payload_dropped_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        AddIndexOnline(model_name="message", index=INDEX),
    ]
