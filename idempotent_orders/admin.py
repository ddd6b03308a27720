"""Django admin for orders, the inbox and parked messages."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone

from idempotent_orders.models import (
    Order,
    OutboxMessage,
    OutboxStatus,
    ParkedMessage,
    ProcessedMessage,
)


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


@admin.register(OutboxMessage)
class OutboxMessageAdmin(admin.ModelAdmin):
    list_display = [
        "message_id",
        "task_name",
        "status",
        "attempts",
        "created_at",
        "sent_at",
        "available_at",
    ]
    list_filter = ["status", "task_name"]
    search_fields = ["message_id", "last_error"]
    readonly_fields = [
        "message_id",
        "task_name",
        "payload",
        "options",
        "status",
        "attempts",
        "available_at",
        "claimed_until",
        "last_error",
        "created_at",
        "sent_at",
    ]
    actions = ["publish_again", "purge_sent"]

    @admin.action(description="Publish again (same message id; consumers dedup)")
    def publish_again(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        count = queryset.update(
            status=OutboxStatus.PENDING, available_at=timezone.now(), claimed_until=None
        )
        self.message_user(request, f"{count} outbox rows queued for the relay.", messages.SUCCESS)

    @admin.action(description="Delete selected rows that were sent")
    def purge_sent(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        deleted, _ = queryset.filter(status=OutboxStatus.SENT).delete()
        self.message_user(request, f"{deleted} sent outbox rows deleted.", messages.SUCCESS)
