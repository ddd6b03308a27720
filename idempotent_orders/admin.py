"""Django admin for orders, the inbox and parked messages."""

from __future__ import annotations

from django.contrib import admin

from idempotent_orders.models import Order, ParkedMessage, ProcessedMessage


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ["id", "status", "version", "last_seq", "amount", "currency", "updated_at"]
    list_filter = ["status", "currency"]
    search_fields = ["business_key", "payment_id", "tracking_number"]
    readonly_fields = ["status", "version", "last_seq", "created_at", "updated_at"]


@admin.register(ProcessedMessage)
class ProcessedMessageAdmin(admin.ModelAdmin):
    list_display = [
        "message_id",
        "consumer",
        "message_type",
        "outcome",
        "status",
        "order",
        "seq",
        "created_at",
    ]
    list_filter = ["consumer", "outcome", "status", "message_type"]
    search_fields = ["message_id", "error"]
    raw_id_fields = ["order"]


@admin.register(ParkedMessage)
class ParkedMessageAdmin(admin.ModelAdmin):
    list_display = ["message_id", "consumer", "order", "seq", "reason", "parked_at", "overdue_at"]
    list_filter = ["consumer", ("overdue_at", admin.EmptyFieldListFilter)]
    raw_id_fields = ["order"]
