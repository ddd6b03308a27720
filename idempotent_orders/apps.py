"""Django application configuration for idempotent_orders."""

import contextlib

from django.apps import AppConfig


class IdempotentOrdersConfig(AppConfig):
    name = "idempotent_orders"
    verbose_name = "Idempotent orders"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from idempotent_orders import checks, receivers  # noqa: F401
        from idempotent_orders.observability import connect

        connect()  # Prometheus metrics, when prometheus-client is installed
        _count_through_the_dedup_layer()
        _register_built_in_types()

        from idempotent_orders import fulfilment, leases
        from idempotent_orders.consuming import running

        leases.register_step(fulfilment.STEP)
        running.register_follow_up(fulfilment.QUEUE_FULFILMENT)
        _connect_timers()
        _register_webhook_admin()


def _register_built_in_types() -> None:
    """Bind the built-in message types to the order model's transitions of the same name.

    A misconfigured order model is reported by the system checks, not raised here.
    """
    from django.core.exceptions import ImproperlyConfigured

    from idempotent_orders import get_order_model
    from idempotent_orders.consuming import registry
    from idempotent_orders.exceptions import UnknownTransition

    with contextlib.suppress(ImproperlyConfigured, UnknownTransition):
        registry.register_built_in(get_order_model())


def _count_through_the_dedup_layer() -> None:
    """Counters flushed to a Redis Cluster go through the fast path's bounded calls."""
    from idempotent_orders import dedup, stats

    stats.write_on_cluster_with(dedup.redis.add_counts)


def _connect_timers() -> None:
    """A new order waiting for payment gets its expiry timer (``PAYMENT_TIMEOUT``)."""
    from django.core.exceptions import ImproperlyConfigured
    from django.db.models.signals import post_save

    from idempotent_orders import get_order_model, timers

    with contextlib.suppress(ImproperlyConfigured):
        post_save.connect(
            timers.schedule_payment_timeout,
            sender=get_order_model(),
            dispatch_uid="idempotent_orders.timers.payment_timeout",
        )


def _register_webhook_admin() -> None:
    """The admin of webhook events and timers lives in its own module; load it with the admin."""
    from django.apps import apps

    if apps.is_installed("django.contrib.admin"):
        from idempotent_orders.webhooks import admin  # noqa: F401
