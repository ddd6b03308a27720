"""The shop binds its message types to its own transitions, as the README's recipe shows."""

from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "tests.shop"
    label = "shop"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from idempotent_orders import get_order_model
        from idempotent_orders.consuming import registry as handlers
        from tests.shop.models import Order

        if get_order_model() is not Order:
            return
        handlers.register(
            "payment.succeeded", transition="settle", validate=handlers.validate_payment
        )
        handlers.register(
            "shipment.dispatched", transition="send", validate=handlers.validate_shipment
        )
        handlers.register(
            "shipment.delivered", transition="receive", validate=handlers.validate_delivery
        )
        handlers.register("order.cancelled", transition="void")
        handlers.register("warehouse.held", transition="hold", consumers={"shipping"})
