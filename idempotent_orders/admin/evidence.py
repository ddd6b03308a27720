"""The other evidence lists, view-only: parked messages (why each waits, judged against
the order as it is now) and the audit trail of operator actions.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import Model, QuerySet
from django.http import HttpRequest
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html
from django.utils.timesince import timesince

from idempotent_orders import get_order_model
from idempotent_orders.admin.common import (
    ConsumerFilter,
    KeySearchMixin,
    ReadOnlyEvidenceAdmin,
    order_link,
    timestamp,
)
from idempotent_orders.admin.dashboard import ParkedAttentionFilter
from idempotent_orders.models import (
    AuditEntry,
    OutboxMessage,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.timeline import held_reason


@admin.display(description="held because (now)")
def _held_now(obj: ParkedMessage) -> str:
    """Why it waits, judged against the order as it is now (not the stored text)."""
    _, why = held_reason(obj)
    return format_html('<div class="io-reason">{}</div>', why)


@admin.display(description="waiting")
def _waiting(obj: ParkedMessage) -> str:
    return timesince(obj.parked_at) if obj.parked_at else ""


@admin.register(ParkedMessage)
class ParkedMessageAdmin(KeySearchMixin, ReadOnlyEvidenceAdmin):
    list_display = [
        "message_id",
        "consumer",
        order_link,
        "seq",
        _held_now,
        timestamp("parked_at", "parked at"),
        _waiting,
        timestamp("overdue_at", "overdue at"),
    ]
    list_filter = [
        ParkedAttentionFilter,
        ConsumerFilter,
        ("overdue_at", admin.EmptyFieldListFilter),
    ]
    list_select_related = ["order"]
    search_fields = ["message_id__exact", "order__pk__exact"]
    key_search_related = ("order",)
    raw_id_fields = ["order"]

    class Media:
        css = {"all": ["idempotent_orders/admin.css"]}


class AuditTargetFilter(admin.SimpleListFilter):
    """The kinds of row operators act on (this app's models), not a ``SELECT DISTINCT``."""

    title = "target"
    parameter_name = "target"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        models: list[type[Model]] = [
            get_order_model(),
            ProcessedMessage,
            ParkedMessage,
            OutboxMessage,
        ]
        return [(m._meta.label_lower, str(m._meta.verbose_name_plural)) for m in models]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(target=value) if value else queryset


@admin.display(description="order", ordering="order_pk")
def _audit_order(obj: AuditEntry) -> str:
    if not obj.order_pk:
        return "-"
    opts = get_order_model()._meta
    try:
        link = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.order_pk])
    except NoReverseMatch:
        return obj.order_pk
    return format_html('<a href="{}">{}</a>', link, obj.order_pk)


@admin.display(description="detail")
def _detail(obj: AuditEntry) -> str:
    return format_html('<div class="io-reason">{}</div>', obj.detail)


@admin.register(AuditEntry)
class AuditEntryAdmin(KeySearchMixin, admin.ModelAdmin):
    list_display = [
        timestamp("created_at", "at"),
        "username",
        "action",
        _audit_order,
        "message_id",
        "result",
        _detail,
    ]
    #: Not "action" or "result": their values are found with SELECT DISTINCT over the
    #: whole table (a bulk requeue audits every row); ?action=<name> still filters.
    list_filter = [AuditTargetFilter]
    #: An order's id or a message id finds every action on it (exactly, not as a substring;
    #: each has an index of its own).
    search_fields = ["order_pk__exact", "message_id__exact"]
    key_search_text = ("order_pk", "message_id")

    class Media:
        css = {"all": ["idempotent_orders/admin.css"]}

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
