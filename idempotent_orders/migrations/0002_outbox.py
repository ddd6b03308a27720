"""The outbox of 0.2: dead letters, order per key, a NOTIFY trigger, trace context.

PostgreSQL: every insert into the outbox notifies ``idempotent_orders_outbox``.

A trigger, not a statement of the producer, so writing a row costs no extra
round trip; notifications of one transaction are delivered once, at commit.
``relay_outbox --loop`` listens on the channel. Other databases: nothing.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

CHANNEL = "idempotent_orders_outbox"

CREATE = f"""
CREATE OR REPLACE FUNCTION idempotent_orders_outbox_notify() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('{CHANNEL}', '');
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS idempotent_orders_outbox_notify ON idempotent_orders_outboxmessage;
CREATE TRIGGER idempotent_orders_outbox_notify
    AFTER INSERT ON idempotent_orders_outboxmessage
    FOR EACH STATEMENT EXECUTE FUNCTION idempotent_orders_outbox_notify();
"""

DROP = """
DROP TRIGGER IF EXISTS idempotent_orders_outbox_notify ON idempotent_orders_outboxmessage;
DROP FUNCTION IF EXISTS idempotent_orders_outbox_notify();
"""


def create(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("idempotent_orders", "0001_initial")]

    operations = [
        # Dead letters.
        migrations.AddField(
            model_name="outboxmessage",
            name="dead_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name="outboxmessage",
            name="status",
            field=models.CharField(
                choices=[("pending", "pending"), ("sent", "sent"), ("dead", "dead")],
                default="pending",
                max_length=16,
            ),
        ),
        # Order per key.
        migrations.AddField(
            model_name="outboxmessage",
            name="order_key",
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
        migrations.AddIndex(
            model_name="outboxmessage",
            index=models.Index(
                fields=["order_key", "status", "id"], name="idempotent__order_k_d7f23e_idx"
            ),
        ),
        # The relay wakes on NOTIFY (PostgreSQL only).
        migrations.RunPython(create, drop, elidable=False),
        # Trace context.
        migrations.AddField(
            model_name="outboxmessage",
            name="correlation_id",
            field=models.CharField(blank=True, default="", max_length=255),
        ),
        migrations.AddField(
            model_name="outboxmessage",
            name="traceparent",
            field=models.CharField(blank=True, default="", max_length=55),
        ),
    ]
