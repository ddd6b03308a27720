import django.db.models.deletion
import django.db.models.functions.datetime
from django.conf import settings
from django.db import migrations, models

# The order model is swappable (settings.IDEMPOTENT_ORDERS_ORDER_MODEL); see 0001.
ORDER_MODEL = getattr(settings, "IDEMPOTENT_ORDERS_ORDER_MODEL", "idempotent_orders.Order")


class Migration(migrations.Migration):
    dependencies = [
        ("idempotent_orders", "0005_outcome_failed"),
        migrations.swappable_dependency(ORDER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="SpentPayment",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("payment_id", models.CharField(max_length=128, unique=True)),
                ("consumer", models.CharField(max_length=64)),
                ("message_id", models.CharField(max_length=255)),
                (
                    "created_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                (
                    "order",
                    models.ForeignKey(
                        blank=True,
                        db_constraint=False,
                        null=True,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to=ORDER_MODEL,
                    ),
                ),
            ],
        ),
    ]
