"""``KeyQuota``: per principal, a bound on its live idempotency keys (PostgreSQL's quota check).

A new table; no existing row changes. A principal without a row has the bound
0, so keys issued before this migration are counted when the quota is near.
"""

from __future__ import annotations

import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("idempotent_orders", "0003_inbox_dead_letters")]

    operations = [
        migrations.CreateModel(
            name="KeyQuota",
            fields=[
                (
                    "principal",
                    models.CharField(max_length=191, primary_key=True, serialize=False),
                ),
                ("bound", models.BigIntegerField(default=0)),
                (
                    "updated_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
            ],
        ),
    ]
