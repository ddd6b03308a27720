"""Inbox dead letters: ``@idempotent`` work that keeps failing ends ``dead``, with ``dead_at``.

A nullable column and a new choice: no table rewrite, no data change.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("idempotent_orders", "0002_outbox")]

    operations = [
        migrations.AddField(
            model_name="processedmessage",
            name="dead_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name="processedmessage",
            name="status",
            field=models.CharField(
                choices=[
                    ("processing", "processing"),
                    ("done", "done"),
                    ("failed", "failed"),
                    ("rejected", "rejected"),
                    ("dead", "dead"),
                ],
                default="done",
                max_length=16,
            ),
        ),
    ]
