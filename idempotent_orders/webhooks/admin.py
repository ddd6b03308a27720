"""Admin of webhook events (read-only evidence, a confirmed and audited replay) and timers.

Loaded from the app's ``ready()`` when ``django.contrib.admin`` is installed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from idempotent_orders.consuming.failures import MessageFailed
from idempotent_orders.idempotent import requeue_inbox
from idempotent_orders.models import (
    AuditEntry,
    InboxStatus,
    Outcome,
    ProcessedMessage,
    Timer,
    WebhookEvent,
    WebhookStatus,
)
from idempotent_orders.webhooks.config import provider
from idempotent_orders.webhooks.ingress import REUSED, process_event


def _inbox(event: WebhookEvent) -> ProcessedMessage | None:
    p = provider(event.provider)
    if p is None or not event.event_id:
        return None
    return ProcessedMessage.objects.filter(consumer=p.consumer, message_id=event.event_id).first()


def _will(event: WebhookEvent, inbox: ProcessedMessage | None) -> str:
    if event.status == WebhookStatus.REJECTED or not event.event_id:
        return "nothing: refused at the door"
    if provider(event.provider) is None:
        return "nothing: the provider is not configured"
    if inbox is None:
        return "consumed now"
    if inbox.status == InboxStatus.DEAD:
        return "requeued, then consumed again"
    if inbox.status == InboxStatus.FAILED:
        return "consumed again"
    return f"duplicate: already {inbox.outcome or inbox.status}, nothing changes"


def _audit(request: HttpRequest, event: WebhookEvent, result: str, detail: str) -> None:
    user = request.user if request.user.is_authenticated else None
    AuditEntry.objects.create(
        user=user,
        username=user.get_username() if user is not None else "",
        action="webhook:replay",
        target=event._meta.label_lower,
        object_id=str(event.pk),
        result=result[:32],
        detail=detail[:2000],
        order_pk=str(event.order_id or "")[:64],
        message_id=(event.event_id or event.claimed_id)[:255],
    )


def _consumed(inbox: ProcessedMessage | None) -> bool:
    """Whether the inbox holds the event's final outcome (a replay then changes nothing)."""
    return (
        inbox is not None
        and inbox.status in (InboxStatus.DONE, InboxStatus.REJECTED)
        and inbox.outcome not in ("", Outcome.FAILED)
    )


def reused(event: WebhookEvent) -> bool:
    """Whether ``event`` is a signed event sent under the id of another, stored, event."""
    return event.status == WebhookStatus.REJECTED and event.error.startswith(f"{REUSED}:")


class FlagFilter(admin.SimpleListFilter):
    """The rows an operator must look at: an event id the provider reused for another event."""

    title = "flag"
    parameter_name = "flag"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("reused", "event id reused for another event")]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[WebhookEvent]
    ) -> QuerySet[WebhookEvent]:
        if self.value() == "reused":
            return queryset.filter(status=WebhookStatus.REJECTED, error__startswith=f"{REUSED}:")
        return queryset


@admin.register(WebhookEvent)
class WebhookEventAdmin(admin.ModelAdmin):
    list_display = [
        "received_at",
        "provider",
        "event_id",
        "event_type",
        "status",
        "outcome",
        "order",
        "deliveries",
        "attempts",
        "flag",
    ]
    list_filter = [FlagFilter, "status", "outcome", "provider", "event_type"]
    search_fields = ["event_id", "claimed_id", "error"]
    raw_id_fields = ["order"]
    actions = ["replay_events"]
    # Stored events are evidence: operators read them, never edit them.
    readonly_fields = [f.name for f in WebhookEvent._meta.fields]

    @admin.display(description="flag")
    def flag(self, event: WebhookEvent) -> str:
        if reused(event):
            return "event id reused for another event: the first event's effect stands"
        return ""

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        flagged = WebhookEvent.objects.filter(
            status=WebhookStatus.REJECTED, error__startswith=f"{REUSED}:"
        ).count()
        if flagged and request.method == "GET":
            self.message_user(
                request,
                f"{flagged} signed event(s) reuse the id of another event (flag: event id "
                "reused): the first event's effect stands, the other was not consumed. "
                "Compare them and settle the payment by hand.",
                messages.WARNING,
            )
        return super().changelist_view(request, extra_context)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_replay_permission(self, request: HttpRequest) -> bool:
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.view_{opts.model_name}") and (
            request.user.has_perm("idempotent_orders.change_processedmessage")
        )

    @admin.action(description="Replay selected events (confirm first)", permissions=["replay"])
    def replay_events(
        self, request: HttpRequest, queryset: QuerySet[WebhookEvent]
    ) -> TemplateResponse | None:
        """Confirm, then consume each event again through the inbox; audit each replay."""
        events = list(queryset.order_by("id"))
        if request.POST.get("post") != "yes":
            plan = []
            for event in events:
                inbox = _inbox(event)
                shown = f"{inbox.status}/{inbox.outcome}" if inbox else ""
                plan.append((event, shown, _will(event, inbox)))
            return TemplateResponse(
                request,
                "admin/idempotent_orders/webhookevent/replay_confirmation.html",
                {
                    **self.admin_site.each_context(request),
                    "title": "Replay webhook events: are you sure?",
                    "subtitle": None,
                    "opts": self.opts,
                    "events": events,
                    "plan": plan,
                    "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                },
            )
        results: Counter[str] = Counter()
        for event in events:
            if event.status == WebhookStatus.REJECTED or not event.event_id:
                result, detail = "skipped", "a refused request is never consumed"
            else:
                inbox = _inbox(event)
                if inbox is not None and inbox.status == InboxStatus.DEAD:
                    requeue_inbox(ids=[inbox.pk])
                before = inbox if _consumed(inbox) else None
                try:
                    outcome = process_event(event.pk)
                except MessageFailed as exc:
                    result, detail = "failed", exc.reason
                else:
                    fresh = WebhookEvent.objects.get(pk=event.pk)
                    if before is not None:
                        # A replay of a consumed event: a duplicate, audited as one.
                        result = "duplicate"
                        detail = (
                            f"replay of an event already {before.outcome} by its first "
                            "consumption; nothing ran again"
                        )
                    else:
                        result = outcome or "failed"
                        detail = f"{fresh.status}: {fresh.error}" if fresh.error else fresh.status
            results[result] += 1
            _audit(request, event, result, detail)
        summary = ", ".join(f"{n} {what}" for what, n in sorted(results.items()))
        level = messages.SUCCESS if not results["failed"] else messages.WARNING
        self.message_user(request, f"Replay: {summary or 'nothing selected'}.", level)
        return None


@admin.register(Timer)
class TimerAdmin(admin.ModelAdmin):
    list_display = [
        "due_at",
        "order",
        "transition",
        "status",
        "outcome",
        "error",
        "attempts",
        "fired_at",
    ]
    list_filter = ["status", "outcome", "transition"]
    search_fields = ["message_id", "error"]
    raw_id_fields = ["order"]
    readonly_fields = [f.name for f in Timer._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
