"""The outbox admin: rows never added or deleted; dead rows requeued once the cause is
fixed, sent rows published again (same message id), each confirmed or audited.
"""

from __future__ import annotations

from collections import Counter

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils import timezone

from idempotent_orders.admin.common import EvidenceAdmin, KeySearchMixin, audit, requeue_dead_rows
from idempotent_orders.models import (
    OutboxMessage,
    OutboxStatus,
)
from idempotent_orders.outbox import requeue_outbox


@admin.register(OutboxMessage)
class OutboxMessageAdmin(KeySearchMixin, EvidenceAdmin):
    list_display = [
        "message_id",
        "task_name",
        "status",
        "attempts",
        "created_at",
        "sent_at",
        "available_at",
        "dead_at",
    ]
    list_filter = ["status"]
    search_fields = ["message_id__exact", "order_key__exact"]
    key_search_text = ("message_id", "order_key")
    search_help_text = "An exact message id or order key."
    readonly_fields = [
        "message_id",
        "task_name",
        "order_key",
        "payload",
        "options",
        "status",
        "attempts",
        "available_at",
        "claimed_until",
        "last_error",
        "created_at",
        "sent_at",
        "dead_at",
    ]
    actions = ["requeue_dead", "publish_again"]

    @admin.action(description="Requeue dead rows (after fixing the cause)", permissions=["change"])
    def requeue_dead(
        self, request: HttpRequest, queryset: QuerySet[OutboxMessage]
    ) -> TemplateResponse | None:
        """Confirm first; then each dead row goes back to pending, audited one by one."""
        return requeue_dead_rows(
            self,
            request,
            queryset,
            what="outbox",
            dead=OutboxStatus.DEAD,
            requeue=requeue_outbox,
            who=("Task", lambda row: row.task_name),
            error=lambda row: row.last_error,
        )

    @admin.action(
        description="Publish again (same message id; consumers dedup)", permissions=["change"]
    )
    def publish_again(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        """Queue sent rows for the relay again, each audited.

        Only a ``sent`` row is queued (conditionally: a row queued meanwhile is
        skipped), so a second click changes nothing and says so; a pending row is
        already queued, and a dead one goes back through the confirmed "requeue".
        """
        results: Counter[str] = Counter()
        for row in queryset.order_by("id"):
            done = (
                OutboxMessage.objects.using(queryset.db)
                .filter(pk=row.pk, status=OutboxStatus.SENT)
                .update(
                    status=OutboxStatus.PENDING, available_at=timezone.now(), claimed_until=None
                )
            )
            if done:
                result, detail = "queued", "sent row queued for the relay again"
            elif row.status == OutboxStatus.DEAD:
                result, detail = "skipped", "dead: requeue it instead; nothing done"
            else:
                result, detail = "skipped", f"{row.status}: already queued; nothing done"
            results[result] += 1
            audit(request, "outbox:publish_again", row, result, detail)
        summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(results.items()))
        if not results["queued"]:
            self.message_user(
                request,
                f"Publish again: nothing more to do ({summary or 'nothing selected'}): pending "
                "rows are already queued, dead rows go back through requeue.",
                messages.WARNING,
            )
        else:
            level = messages.SUCCESS if not results["skipped"] else messages.WARNING
            self.message_user(request, f"Publish again: {summary}.", level)
