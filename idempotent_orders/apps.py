"""Django application configuration for idempotent_orders."""

from django.apps import AppConfig


class IdempotentOrdersConfig(AppConfig):
    name = "idempotent_orders"
    verbose_name = "Idempotent orders"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from idempotent_orders import checks, receivers  # noqa: F401
        from idempotent_orders.observability import connect

        connect()  # Prometheus metrics, when prometheus-client is installed
