"""The shop's admin for its own order model, as the README's recipe shows."""

from django.contrib import admin

from idempotent_orders import get_order_model
from idempotent_orders.admin import OrderAdminMixin
from tests.shop.models import Order, ParcelReturn


class ShopOrderAdmin(OrderAdminMixin, admin.ModelAdmin):
    list_display = ["id", "phase", "version", "amount", "currency", "blocked"]
    list_filter = ["phase", "blocked"]
    # Voiding an unpaid order is the operator's call; `hold` waits for the warehouse's message.
    operator_transitions = ["void"]
    # The state fields and records of the differential suite's proxies (see models.py).
    exclude = ["flow", "istate", "kstate", "paid_total", "note"]


# Like the handlers in apps.py: only when shop.Order is the configured order model.
if get_order_model() is Order:
    admin.site.register(Order, ShopOrderAdmin)


# Not the order model, and `note` has no target state (target=None): registering it must
# not crash django.setup(); the admin shows returns and offers no transition actions.
@admin.register(ParcelReturn)
class ParcelReturnAdmin(OrderAdminMixin, admin.ModelAdmin):
    list_display = ["id", "parcel", "status", "version"]
