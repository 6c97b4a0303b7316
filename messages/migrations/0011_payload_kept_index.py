"""The partial index the payload drop reads (`a2a_payload_kept`), built online.

On PostgreSQL it is built CONCURRENTLY, so writes go on while it builds (measured at
1,000,000 rows in docs/performance.md). A concurrent build cannot run in a transaction, so
this migration is not atomic and holds this one step only; a build that failed (a deadlock,
a cancel, a unique violation elsewhere) leaves an INVALID index behind, which a rerun finds,
drops and builds again. Other databases build it the ordinary way.

Reversed (with 0010), the console no longer knows which payloads were dropped: a resend of
one sends `null`. Reverse only onto code that has never dropped a payload.
"""

from django.db import migrations, models

INDEX = models.Index(
    condition=models.Q(("message_type__in", ["TASK_REQUEST", "TASK_RESPONSE"]),
                       ("payload__isnull", False)),
    fields=["updated_at"], name="a2a_payload_kept")


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
        ("a2a", "0010_payload_retention"),
    ]

    operations = [
        AddIndexOnline(model_name="message", index=INDEX),
    ]
