"""PostgreSQL: every insert into the outbox notifies ``idempotent_orders_outbox``.

A trigger, not a statement of the producer, so writing a row costs no extra
round trip; notifications of one transaction are delivered once, at commit.
``relay_outbox --loop`` listens on the channel. Other databases: nothing.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

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
    dependencies = [("idempotent_orders", "0003_outbox_order_key")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
