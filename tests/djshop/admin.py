"""django-SHOP's order in the admin: cancelling is the operator's call."""

from django.contrib import admin

from idempotent_orders.admin import OrderAdminMixin
from tests.djshop.models import Order


@admin.register(Order)
class ShopOrderAdmin(OrderAdminMixin, admin.ModelAdmin):
    list_display = ["id", "status", "version"]
    # ``cancel_order`` picks its target in its body (RETURN_VALUE); the other two entries
    # get no action (a targetless transition, a name the model lacks): W046 says so.
    operator_transitions = ["cancel_order", "acknowledge_prepayment", "close"]
