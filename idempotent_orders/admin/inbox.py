"""The inbox admin (``ProcessedMessage``): the evidence of every message consumed,
view-only, with its row actions (retry, complete after verification, mark failed,
requeue dead rows), each confirmed first and audited, and the one-row "fix" links.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html

from idempotent_orders import leases, reconcile
from idempotent_orders.admin.common import (
    ConsumerFilter,
    KeySearchMixin,
    ReadOnlyEvidenceAdmin,
    audit,
    next_url,
    order_link,
    requeue_dead_rows,
    timestamp,
)
from idempotent_orders.admin.dashboard import AttentionFilter, tell_what_is_left
from idempotent_orders.consuming.registry import registered
from idempotent_orders.consuming.single import redeliver
from idempotent_orders.idempotent import load_step, requeue_inbox
from idempotent_orders.leases import StepResult
from idempotent_orders.models import (
    InboxStatus,
    Outcome,
    ProcessedMessage,
)
from idempotent_orders.timeline import at, inbox_fix


@dataclass
class RowPlan:
    """What an inbox row action will do to one row, in words, before it runs."""

    row: ProcessedMessage
    applies: bool
    text: str


def _consumed_message(row: ProcessedMessage) -> bool:
    """A consumed message that keeps its envelope (a failed one is consumed again from it)."""
    return bool(row.body) and load_step(row) is None and row.message_type != ""


def _plan_retry(row: ProcessedMessage, now: datetime) -> RowPlan:
    if row.status == InboxStatus.DEAD:
        return RowPlan(row, False, "dead: requeue it instead (Requeue dead rows), once fixed")
    if row.status not in (InboxStatus.PROCESSING, InboxStatus.FAILED):
        return RowPlan(row, False, f"{row.outcome or row.status}: nothing to retry")
    if row.lease_expires_at is not None and row.lease_expires_at > now:
        return RowPlan(row, False, f"a worker holds it until {at(row.lease_expires_at)}")
    if load_step(row) is not None:
        return RowPlan(
            row,
            True,
            f"asks {row.consumer} first whether it already happened: completes if so, "
            "otherwise runs it again with the same idempotency key",
        )
    if _consumed_message(row) and (
        row.status == InboxStatus.FAILED or row.lease_expires_at is None
    ):
        return RowPlan(
            row,
            True,
            "consumes the message again from the envelope it keeps: it takes effect once, "
            "or stays failed with the new reason",
        )
    return RowPlan(row, False, f"no step is registered for {row.consumer!r} to run it again")


def _retry(row: ProcessedMessage) -> str:
    if load_step(row) is not None:
        return reconcile.retry(row.pk).value
    result = redeliver([row.pk]).get(row.pk, StepResult.SKIPPED.value)
    return result.value if isinstance(result, Outcome) else str(result).split(":", 1)[0]


def _plan_complete(row: ProcessedMessage, now: datetime) -> RowPlan:
    if row.status not in (InboxStatus.PROCESSING, InboxStatus.FAILED):
        return RowPlan(row, False, f"{row.outcome or row.status}: nothing to complete")
    if load_step(row) is None:
        return RowPlan(row, False, f"no step is registered for {row.consumer!r} to verify it")
    if row.status == InboxStatus.PROCESSING and (
        row.lease_expires_at is not None and row.lease_expires_at > now
    ):
        return RowPlan(row, False, f"a worker holds it until {at(row.lease_expires_at)}")
    return RowPlan(
        row,
        True,
        f"asks {row.consumer} whether it happened: completes it only if so, "
        "otherwise leaves it for a retry",
    )


def _plan_fail(row: ProcessedMessage, now: datetime) -> RowPlan:
    if row.status != InboxStatus.PROCESSING:
        return RowPlan(row, False, f"{row.outcome or row.status}: not in processing")
    if row.lease_expires_at is not None and row.lease_expires_at > now:
        return RowPlan(row, False, f"a worker holds it until {at(row.lease_expires_at)}")
    return RowPlan(row, True, "marked failed: the reconciler leaves it for an operator")


def _fail(row: ProcessedMessage) -> str:
    if row.status != InboxStatus.PROCESSING:
        return StepResult.SKIPPED.value
    if row.lease_expires_at is not None and row.lease_expires_at > timezone.now():
        return "busy"  # a live lease: a worker is on it
    done = leases.fail(row.pk, reason="failed by an operator", attempt=row.attempts)
    return StepResult.FAILED.value if done else StepResult.SKIPPED.value


#: Results after which the row needs nothing more.
_SETTLED = {"completed", "applied", "duplicate", "stale", "requeued"}
#: A row action's result as the operator reads it.
_SAID = {
    "retry": "not finished, it waits for the next attempt",
    "skipped": "nothing done: a worker or another operator has it",
    "busy": "nothing done: a worker holds its lease",
    "failed": "failed",
}


def _row_now(row: ProcessedMessage) -> str:
    """The row as it is after an action, in words."""
    state = row.outcome or row.status if row.status == InboxStatus.DONE else row.status
    return f"now {state}" + (f": {row.error}" if row.error else "")


def _row_name(row: ProcessedMessage) -> str:
    order = f" (order {row.order_id})" if row.order_id is not None else ""
    return f"{row.consumer}:{row.message_id}{order}"


def _row_action(
    verb: str,
    run: Callable[[ProcessedMessage], StepResult | str],
    description: str,
    planner: Callable[[ProcessedMessage, datetime], RowPlan],
) -> Callable[..., TemplateResponse | None]:
    """An inbox row action: a confirmation page first, then one audited run per row, and
    a message per row saying what happened and what the row is now."""

    def action(
        modeladmin: admin.ModelAdmin[ProcessedMessage],
        request: HttpRequest,
        queryset: QuerySet[ProcessedMessage],
    ) -> TemplateResponse | None:
        now = timezone.now()
        rows = list(queryset.order_by("id"))
        plans = [planner(row, now) for row in rows]
        if request.POST.get("post") != "yes":
            opts = modeladmin.opts
            return TemplateResponse(
                request,
                "admin/idempotent_orders/processedmessage/action_confirmation.html",
                {
                    **modeladmin.admin_site.each_context(request),
                    "title": f"{description}: are you sure?",
                    "subtitle": None,
                    "opts": opts,
                    "action": verb,
                    "label": description,
                    "plans": plans,
                    "applicable": any(p.applies for p in plans),
                    "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                    "next": next_url(request),
                },
            )
        for p in plans:
            row = p.row
            result = run(row) if p.applies else StepResult.SKIPPED.value
            value = result.value if isinstance(result, StepResult) else result
            row.refresh_from_db()
            said = p.text if p.applies else f"nothing done: {p.text}"
            audit(request, verb, row, value, f"{_row_name(row)}: {said}; {value}; {_row_now(row)}")
            level = messages.SUCCESS if value in _SETTLED else messages.WARNING
            if not p.applies:
                level = messages.INFO
            messages.add_message(
                request,
                level,
                f"{description} {_row_name(row)}: "
                f"{_SAID.get(value, value) if p.applies else said}; {_row_now(row)}.",
            )
        if not plans:
            messages.add_message(request, messages.INFO, f"{description}: nothing selected.")
        tell_what_is_left(request)
        return None

    action.__name__ = verb
    return admin.action(description=description, permissions=["operate"])(action)


@admin.display(description="reason")
def _reason(obj: ProcessedMessage) -> str:
    """The whole reason, wrapped: read without scrolling sideways."""
    if not obj.error:
        return ""
    return format_html('<div class="io-reason">{}</div>', obj.error)


class MessageTypeFilter(admin.SimpleListFilter):
    """The registered message types (from the code, not a ``SELECT DISTINCT`` over the table)."""

    title = "message type"
    parameter_name = "message_type"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(h.message_type, h.message_type) for h in registered()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(message_type=value) if value else queryset


@admin.display(description="fix")
def _fix(obj: ProcessedMessage) -> str:
    """One link per row that needs an operator: its one-row confirmation page."""
    verb = inbox_fix(obj)
    if not verb:
        return ""
    url = reverse("admin:idempotent_orders_processedmessage_confirm", args=[obj.pk, verb])
    label = "Requeue…" if verb == "requeue_dead" else "Retry…"
    return format_html('<a class="button io-fix" href="{}">{}</a>', url, label)


@admin.register(ProcessedMessage)
class ProcessedMessageAdmin(KeySearchMixin, ReadOnlyEvidenceAdmin):
    # What an operator acts on first (the reason and its fix), then the details: on a
    # laptop with the admin's sidebar and the filters, the first columns are what shows.
    list_display = [
        "message_id",
        order_link,
        "status",
        _fix,
        _reason,
        "consumer",
        "message_type",
        "outcome",
        "seq",
        timestamp("created_at", "created at"),
        "attempts",
        timestamp("lease_expires_at", "lease expires at"),
        timestamp("dead_at", "dead at"),
    ]
    list_filter = [AttentionFilter, ConsumerFilter, "outcome", "status", MessageTypeFilter]
    search_fields = ["message_id__exact", "order__pk__exact"]
    key_search_related = ("order",)
    raw_id_fields = ["order"]
    actions = [
        _row_action("retry", _retry, "Retry (verifies first)", _plan_retry),
        _row_action(
            "complete_verified",
            lambda row: reconcile.complete_if_verified(row.pk),
            "Complete after verification",
            _plan_complete,
        ),
        _row_action("fail", _fail, "Mark failed", _plan_fail),
        "requeue_dead",
    ]

    class Media:
        css = {"all": ["idempotent_orders/admin.css"]}

    def get_urls(self) -> list[Any]:
        confirm = self.admin_site.admin_view(self.confirm_view)
        opts = self.opts
        return [
            path(
                "<path:object_id>/confirm/<str:verb>/",
                confirm,
                name=f"{opts.app_label}_{opts.model_name}_confirm",
            ),
            *super().get_urls(),
        ]

    def confirm_view(self, request: HttpRequest, object_id: str, verb: str) -> HttpResponse:
        """One row's action from a link (the changelist's "fix" column, an order's timeline):
        the same confirmation page as the action, and on "Yes" the same audited run."""
        found = self.get_actions(request).get(verb)  # only those the user may run
        if found is None:
            return HttpResponseRedirect(reverse("admin:index"))
        # Django 6.1 hands out Action objects (func, name, ...), earlier Djangos tuples.
        action: Any = found
        run: Any = action.func if hasattr(action, "func") else action[0]
        queryset = self.get_queryset(request).filter(pk=object_id)
        response = run(self, request, queryset)
        if response is not None:
            return response
        back = next_url(request) or reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist"
        )
        return HttpResponseRedirect(back)

    @admin.action(description="Requeue dead rows (after fixing the cause)", permissions=["operate"])
    def requeue_dead(
        self, request: HttpRequest, queryset: QuerySet[ProcessedMessage]
    ) -> TemplateResponse | None:
        """Confirm first; then each dead row goes back to processing, audited one by one.

        The next delivery of its message runs the work again.
        """
        return requeue_dead_rows(
            self,
            request,
            queryset,
            what="inbox",
            dead=InboxStatus.DEAD,
            requeue=_requeue_and_redeliver,
            who=("Consumer", lambda row: row.consumer),
            error=lambda row: row.error,
        )

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """The row actions: retry, complete, fail (each through the reconciler's functions)."""
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")


def _requeue_and_redeliver(*, ids: list[int], using: str | None = None) -> int:
    """Requeue dead inbox rows; a consumed message among them (it keeps its envelope) is
    consumed again at once, and takes effect exactly once or is kept as failed again.
    """
    done = requeue_inbox(ids=ids, using=using)
    if done:
        redeliver(ids)
    return done
