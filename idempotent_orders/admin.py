"""Django admin for orders, the inbox and parked messages."""

from __future__ import annotations

from django.contrib import admin

from idempotent_orders.models import IdempotencyKey, Order, ParkedMessage, ProcessedMessage


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
    list_display = ["message_id", "consumer", "order", "seq", "reason", "parked_at"]
    list_filter = ["consumer"]
    raw_id_fields = ["order"]


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(admin.ModelAdmin):
    list_display = [
        "key",
        "principal",
        "method",
        "route",
        "state",
        "response_status",
        "lease_expires_at",
        "expires_at",
    ]
    list_filter = ["state", "is_token", "method"]
    search_fields = ["key", "principal", "route"]
    # Stored responses are evidence: operators read them, never edit them.
    readonly_fields = [f.name for f in IdempotencyKey._meta.fields]
