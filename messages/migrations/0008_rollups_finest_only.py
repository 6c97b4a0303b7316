from django.db import migrations, models


def earlier_rows_settle(apps, schema_editor):
    """Rows written before this version hold each count once per width already: marked
    folded, a wider read does not add the finest ones to it again (a key may have several
    folded rows; a reader sums them)."""
    apps.get_model("a2a", "Rollup").objects.filter(folded=False).update(folded=True)


class Migration(migrations.Migration):

    dependencies = [
        ('a2a', '0007_operators_cancel'),
    ]

    operations = [
        migrations.RunPython(earlier_rows_settle, migrations.RunPython.noop),
        migrations.RemoveIndex(
            model_name='rollup',
            name='a2a_rollup_unfolded',
        ),
        migrations.AddIndex(
            model_name='rollup',
            index=models.Index(condition=models.Q(('folded', False)), fields=['step', 'scope', 'subject', 'bucket'], name='a2a_rollup_unfolded'),
        ),
    ]
