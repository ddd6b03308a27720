"""Django admin for orders, the inbox and parked messages.

Every action goes through the same services as the workers
(:func:`~idempotent_orders.transitions.apply_transition`, the reconciler's
functions), is idempotent (a second click finds nothing to do) and is recorded
as an :class:`~idempotent_orders.models.AuditEntry`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.db.models import Model, QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.timesince import timesince

from idempotent_orders import leases, reconcile
from idempotent_orders.leases import StepResult
from idempotent_orders.models import (
    AuditEntry,
    IdempotencyKey,
    InboxStatus,
    Order,
    OutboxMessage,
    OutboxStatus,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.transitions import TransitionStatus, apply_transition, edges


def audit(
    request: HttpRequest, action: str, obj: Model, result: str, detail: str = ""
) -> AuditEntry:
    """Record one operator action on ``obj``."""
    user = request.user if request.user.is_authenticated else None
    return AuditEntry.objects.create(
        user=user,
        username=user.get_username() if user is not None else "",
        action=action,
        target=obj._meta.label_lower,
        object_id=str(obj.pk),
        result=result,
        detail=detail[:2000],
    )


def _report(request: HttpRequest, verb: str, results: Counter[str]) -> None:
    summary = ", ".join(f"{n} {what}" for what, n in sorted(results.items()))
    level = messages.SUCCESS if set(results) <= {"applied", "completed"} else messages.WARNING
    messages.add_message(request, level, f"{verb}: {summary or 'nothing selected'}.")


def _transition_action(name: str) -> Callable[..., None]:
    def action(modeladmin: admin.ModelAdmin[Order], request: HttpRequest, queryset: Any) -> None:
        results: Counter[str] = Counter()
        for order in queryset:
            result = apply_transition(order, name)
            results[result.status.value] += 1
            detail = f"{result.source} -> {result.target} at v{result.version}"
            audit(request, f"transition:{name}", order, result.status.value, detail)
            if result.status is TransitionStatus.CONFLICT:
                messages.warning(
                    request,
                    f"Order {order.pk} changed while you looked at it; reload and try again.",
                )
        _report(request, name, results)

    action.__name__ = f"transition_{name}"
    return admin.action(description=f"Transition: {name}", permissions=["change"])(action)


class AttentionFilter(admin.SimpleListFilter):
    """What an operator looks for: stuck leased work, rejections, failures."""

    title = "needs attention"
    parameter_name = "attention"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("stuck", "stuck in processing (lease expired)"),
            ("processing", "processing"),
            ("rejected", "rejected"),
            ("failed", "failed"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "stuck":
            return queryset.filter(
                status=InboxStatus.PROCESSING, lease_expires_at__lt=timezone.now()
            )
        if value in {"processing", "rejected", "failed"}:
            return queryset.filter(status=value)
        return queryset


def _row_action(
    verb: str, run: Callable[[ProcessedMessage], StepResult | str], description: str
) -> Callable[..., None]:
    def action(
        modeladmin: admin.ModelAdmin[ProcessedMessage],
        request: HttpRequest,
        queryset: QuerySet[ProcessedMessage],
    ) -> None:
        results: Counter[str] = Counter()
        for row in queryset:
            result = run(row)
            value = result.value if isinstance(result, StepResult) else result
            results[value] += 1
            row.refresh_from_db()
            audit(request, verb, row, value, f"now {row.status}: {row.error}")
        _report(request, description, results)

    action.__name__ = verb
    return admin.action(description=description, permissions=["change"])(action)


def _fail(row: ProcessedMessage) -> str:
    if row.status != InboxStatus.PROCESSING:
        return StepResult.SKIPPED.value
    if row.lease_expires_at is not None and row.lease_expires_at > timezone.now():
        return "busy"  # a live lease: a worker is on it
    done = leases.fail(row.pk, reason="failed by an operator", attempt=row.attempts)
    return StepResult.FAILED.value if done else StepResult.SKIPPED.value


@admin.display(description="waiting")
def _waiting(obj: ParkedMessage) -> str:
    return timesince(obj.parked_at) if obj.parked_at else ""


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ["id", "status", "version", "last_seq", "amount", "currency", "updated_at"]
    list_filter = ["status", "currency"]
    search_fields = ["business_key", "payment_id", "tracking_number"]
    readonly_fields = ["status", "version", "last_seq", "created_at", "updated_at"]
    actions = [_transition_action(e.name) for e in edges(Order)]


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
        "attempts",
        "lease_expires_at",
        "error",
    ]
    list_filter = [AttentionFilter, "consumer", "outcome", "status", "message_type"]
    search_fields = ["message_id", "error"]
    raw_id_fields = ["order"]
    actions = [
        _row_action("retry", lambda row: reconcile.retry(row.pk), "Retry (verifies first)"),
        _row_action(
            "complete_verified",
            lambda row: reconcile.complete_if_verified(row.pk),
            "Complete after verification",
        ),
        _row_action("fail", _fail, "Mark failed"),
    ]


@admin.register(ParkedMessage)
class ParkedMessageAdmin(admin.ModelAdmin):
    list_display = [
        "message_id",
        "consumer",
        "order",
        "seq",
        "reason",
        "parked_at",
        _waiting,
        "overdue_at",
    ]
    list_filter = ["consumer", ("overdue_at", admin.EmptyFieldListFilter)]
    raw_id_fields = ["order"]


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = ["created_at", "username", "action", "target", "object_id", "result"]
    list_filter = ["action", "result", "target"]
    search_fields = ["username", "object_id", "detail"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


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
