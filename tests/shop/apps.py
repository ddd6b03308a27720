"""The shop binds its message types to its own transitions, as the README's recipe shows."""

from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "tests.shop"
    label = "shop"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from idempotent_orders import get_order_model
        from idempotent_orders.consuming import registry
        from tests.shop.models import Order

        if get_order_model() is not Order:
            return
        registry.register(
            "payment.succeeded", transition="settle", validate=registry.validate_payment
        )
        registry.register(
            "shipment.dispatched", transition="send", validate=registry.validate_shipment
        )
        registry.register(
            "shipment.delivered", transition="receive", validate=registry.validate_delivery
        )
        registry.register("order.cancelled", transition="void")
        registry.register("warehouse.held", transition="hold", consumers={"shipping"})
