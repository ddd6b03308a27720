"""The demo's admin for its own order model: ``OrderAdminMixin`` on a ``ModelAdmin``."""

from django.contrib import admin

from demo_project.models import ShopOrder
from idempotent_orders import get_order_model
from idempotent_orders.admin import OrderAdminMixin


class ShopOrderAdmin(OrderAdminMixin, admin.ModelAdmin):
    list_display = ["id", "business_key", "state", "version", "amount", "currency", "updated_at"]
    list_filter = ["state", "currency"]
    search_fields = ["business_key", "payment_id", "tracking_number"]
    readonly_fields = ["created_at", "updated_at"]
    # What the transitions' bodies record from the messages: read-only in the form.
    message_owned_fields = ["payment_id", "amount_paid", "paid_at", "tracking_number", "carrier"]
    # `cancel` and `expire` (the mixin's default operator_transitions) are the operator's call.


# Like the message types in apps.py: only when ShopOrder is the configured order model
# (the test suite runs the demo's views on the default model).
if get_order_model() is ShopOrder:
    admin.site.register(ShopOrder, ShopOrderAdmin)
