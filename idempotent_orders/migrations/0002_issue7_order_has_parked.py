"""Order.has_parked: lets the consumer skip the parked-successor look on orders that never parked."""

from typing import Any

from django.db import migrations, models


def flag_orders_with_parked(apps: Any, schema_editor: Any) -> None:
    Order = apps.get_model("idempotent_orders", "Order")
    ParkedMessage = apps.get_model("idempotent_orders", "ParkedMessage")
    Order.objects.filter(pk__in=ParkedMessage.objects.values("order_id")).update(has_parked=True)


class Migration(migrations.Migration):
    dependencies = [("idempotent_orders", "0001_initial")]

    operations = [
        migrations.AddField(
            model_name="order",
            name="has_parked",
            field=models.BooleanField(default=False, editable=False),
        ),
        migrations.RunPython(flag_orders_with_parked, migrations.RunPython.noop),
    ]
