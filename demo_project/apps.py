"""App config of the demo project: its own order model's message types, its management command."""

from django.apps import AppConfig


class DemoProjectConfig(AppConfig):
    name = "demo_project"
    verbose_name = "Demo shop"

    def ready(self) -> None:
        from demo_project.models import ShopOrder
        from idempotent_orders import get_order_model
        from idempotent_orders.consuming import registry

        if get_order_model() is not ShopOrder:
            return  # the test suite runs the demo's views on the default model
        # The recipe for a project's own order model: bind each message type to
        # one of the model's transitions (the built-in validators check only the
        # fields the model has). "refund" and "cancel" keep the built-in names.
        # --8<-- [start:bindings]
        registry.register(
            "payment.succeeded",
            transition="mark_paid",
            validate=registry.validate_payment,
            money=True,  # a payment that cannot apply is money to give back
        )
        registry.register(
            "shipment.dispatched", transition="dispatch", validate=registry.validate_shipment
        )
        registry.register(
            "shipment.delivered", transition="deliver", validate=registry.validate_delivery
        )
        registry.register("warehouse.packed", transition="pack", consumers={"shipping"})
        # --8<-- [end:bindings]
