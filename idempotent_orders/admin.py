"""Django admin for orders, the inbox, parked messages, the outbox and keys.

The order admin is :class:`OrderAdminMixin` on a ``ModelAdmin``. Like
``UserAdmin`` for ``auth.User``, :class:`OrderAdmin` is registered only when the
order model is the default ``idempotent_orders.Order``; a project with its own
(``IDEMPOTENT_ORDERS_ORDER_MODEL``) registers its model with the mixin. The
mixin reads everything from the model: its state field, its transitions, the
columns it has.

The admin cannot break the guarantee the workers keep:

- **The order form** carries the version it was opened at (a hidden field). A
  save is one conditional ``UPDATE ... WHERE version = <that version>`` that
  bumps ``version``; a stale save changes nothing and names the fields that
  changed. What messages own (the state field, ``version``, ``last_seq``,
  ``has_parked`` and the columns of ``message_owned_fields``: ``payment_id``,
  ``tracking_number``, ``carrier`` where they exist) is read-only, so is
  ``business_key`` once the order exists, and ``amount``/``currency`` too once
  the order left its initial state (a payment was checked against them).
- **Evidence is never added or deleted**: inbox (``ProcessedMessage``), parked,
  outbox and ``IdempotencyKey`` rows (deleting an inbox row would let its
  message take effect again); retention is the purge commands' job. Inbox,
  parked and key rows are view-only too: saving their form would write back
  every column as it was read.
  An order a message refers to cannot be deleted either (its inbox rows would
  lose their order and its parked messages would go with it); an order no
  message touched (created by mistake) can.
- **Transition actions** (one per declared transition with a target state, labelled "Mark as
  shipped") show a confirmation page listing every selected order, its state
  and what will happen; they honour the transition's fsm-2 ``permission=`` and
  ``conditions=``, report per order in words, and are audited. Rules:

  - ``cancel``, ``expire`` (the mixin's ``operator_transitions``): the
    operator's decision (no money moved yet, no effect outside the database);
  - ``start_processing`` (the fulfilment step's transition,
    :func:`~idempotent_orders.fulfilment.transition`): only through the leased fulfilment step
    (:func:`~idempotent_orders.fulfilment.fulfil`), which asks the warehouse
    once with the step's idempotency key; an unpaid order is refused without
    touching the inbox;
  - ``pay``, ``ship``, ``complete``, ``refund`` (any transition a message type
    drives): only to apply a message of that type the inbox refused for the
    order (a ``rejected``/``failed`` row) whose payload validates now (e.g. the
    amount was corrected); the payment id, tracking number, ... come from that
    message and the audit entry names it. Without one the action refuses: only
    the payment provider or the warehouse can say it happened.

- **The app index** shows what needs an operator (:func:`attention`): stuck and
  failed leased work, rejections today, overdue parked messages, the pending
  outbox, each count linking to the list of exactly those rows.

Every action goes through the same services as the workers
(:func:`~idempotent_orders.consuming.running.apply_transition`, the reconciler's
functions), is idempotent (a second click finds nothing to do) and is recorded
as an :class:`~idempotent_orders.models.AuditEntry`.
"""

from __future__ import annotations

import enum
import inspect
import json
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import flatten_fieldsets
from django.db import transaction
from django.db.models import F, Model, Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.timesince import timesince

from idempotent_orders import fulfilment, get_order_model, leases, liveness, reconcile
from idempotent_orders.conf import conf
from idempotent_orders.consuming.decision import REFUND
from idempotent_orders.consuming.graph import (
    Edge,
    TransitionStatus,
    classify,
    current_state,
    edge,
    edges,
    has_transition,
    state_field,
    unmet_conditions,
)
from idempotent_orders.consuming.registry import registered
from idempotent_orders.consuming.running import apply_transition, written_values
from idempotent_orders.consuming.single import parse_envelope, redeliver
from idempotent_orders.exceptions import InvalidMessage, UnknownTransition
from idempotent_orders.idempotent import load_step, requeue_inbox
from idempotent_orders.leases import StepResult
from idempotent_orders.models import (
    AuditEntry,
    IdempotencyKey,
    InboxStatus,
    Order,
    OutboxMessage,
    OutboxStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.outbox import outbox_stats, requeue_outbox
from idempotent_orders.timeline import at, held_reason, inbox_fix, timeline


def _names(obj: Model) -> tuple[str, str]:
    """The order (its pk as text) and the message id ``obj`` concerns, "" where none."""
    if isinstance(obj, get_order_model()):
        return str(obj.pk), ""
    order_id = getattr(obj, "order_id", None)
    if order_id is None and isinstance(obj, OutboxMessage):
        order_id = obj.order_key
    return ("" if order_id is None else str(order_id)), str(getattr(obj, "message_id", "") or "")


def audit(
    request: HttpRequest, action: str, obj: Model, result: str, detail: str = ""
) -> AuditEntry:
    """Record one operator action on ``obj``, naming its order and message (searchable)."""
    user = request.user if request.user.is_authenticated else None
    order_pk, message_id = _names(obj)
    return AuditEntry.objects.create(
        user=user,
        username=user.get_username() if user is not None else "",
        action=action,
        target=obj._meta.label_lower,
        object_id=str(obj.pk),
        result=result,
        detail=detail[:2000],
        order_pk=order_pk[:64],
        message_id=message_id[:255],
    )


def left_to_do(user: Any) -> str:
    """What still needs an operator, in one sentence (said after every action)."""
    due = [f"{line.count} {line.short}" for line in attention(user) if line.count and line.short]
    if not due:
        return "Nothing else needs attention now."
    return f"Still needing attention: {', '.join(due)}."


def _tell_what_is_left(request: HttpRequest) -> None:
    messages.add_message(request, messages.INFO, left_to_do(request.user))


class AttentionFilter(admin.SimpleListFilter):
    """What an operator looks for: stuck leased work, rejections, failures."""

    title = "needs attention"
    parameter_name = "attention"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("stuck", "stuck in processing (lease expired)"),
            ("processing", "processing"),
            ("rejected", "rejected"),
            ("rejected_today", "rejected today"),
            ("failed", "failed"),
            ("dead", "dead (@idempotent work that keeps failing)"),
            ("refund", "money to give back (a payment that cannot apply)"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "stuck":
            return queryset.filter(
                status=InboxStatus.PROCESSING, lease_expires_at__lt=timezone.now()
            )
        if value == "rejected_today":
            return queryset.filter(status=InboxStatus.REJECTED, created_at__gte=_start_of_today())
        if value == "refund":
            return queryset.filter(status=InboxStatus.REJECTED, error__endswith=REFUND)
        if value in {"processing", "rejected", "failed", "dead"}:
            return queryset.filter(status=value)
        return queryset


def _start_of_today() -> datetime:
    return timezone.localtime().replace(hour=0, minute=0, second=0, microsecond=0)


def _overdue_cutoff() -> datetime:
    return timezone.now() - timedelta(seconds=conf.PARKED_TIMEOUT)


def _held_cutoff() -> datetime:
    return timezone.now() - timedelta(seconds=conf.PARKED_ATTENTION_AFTER)


def _minutes(seconds: int) -> str:
    if seconds % 60:
        return f"{seconds} seconds"
    minutes = seconds // 60
    return "1 minute" if minutes == 1 else f"{minutes} minutes"


class ParkedAttentionFilter(admin.SimpleListFilter):
    """Parked messages waiting longer than ``PARKED_TIMEOUT``, marked overdue or not yet."""

    title = "needs attention"
    parameter_name = "attention"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("held", f"held longer than {_minutes(conf.PARKED_ATTENTION_AFTER)}"),
            ("overdue", "overdue (waiting longer than PARKED_TIMEOUT)"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "held":
            return queryset.filter(parked_at__lte=_held_cutoff())
        if self.value() == "overdue":
            return queryset.filter(
                Q(overdue_at__isnull=False) | Q(parked_at__lte=_overdue_cutoff())
            )
        return queryset


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
                    "next": _next_url(request),
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
        _tell_what_is_left(request)
        return None

    action.__name__ = verb
    return admin.action(description=description, permissions=["operate"])(action)


def _next_url(request: HttpRequest) -> str:
    """Where to go once a one-row confirmation is done: the page the operator came from."""
    wanted = request.POST.get("next") or request.GET.get("next") or ""
    if wanted and url_has_allowed_host_and_scheme(
        wanted, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return wanted
    return ""


@dataclass(frozen=True)
class Attention:
    """One line of the attention dashboard: a count and where to see the rows."""

    key: str
    label: str
    count: int
    url: str
    note: str = ""
    #: The line in a few words ("2 stuck"), for "what is left" after an action; "" to omit.
    short: str = ""


def _some(names: list[str], shown: int = 3) -> str:
    """A few names, each cut short, and how many more (the dashboard's note stays short)."""
    cut = [n if len(n) <= 32 else f"{n[:31]}…" for n in names[:shown]]
    more = len(names) - shown
    return ", ".join(cut) + (f" and {more} more" if more > 0 else "")


def _liveness_lines(stuck_url: str) -> list[Attention]:
    """Workers gone quiet and the reconciler's last pass, from their heartbeats."""
    if not liveness.shared():
        # Another process's beats cannot reach this one: say so, claim nothing.
        local = "LOCK_CACHE is local to each process: no heartbeat can be seen here"
        return [
            Attention("workers_gone", "Workers not heard from", 0, stuck_url, local),
            Attention("reconciler", "Reconciler last pass", 0, stuck_url, local),
        ]
    workers = liveness.ages("worker:")
    gone = sorted(
        name.removeprefix("worker:") for name, age in workers.items() if age > liveness.SILENT_AFTER
    )
    alive = len(workers) - len(gone)
    reconciler = liveness.ages("reconciler").get("reconciler")
    late = reconciler is None or reconciler > 5 * 60
    return [
        Attention(
            "workers_gone",
            f"Workers not heard from for {liveness.SILENT_AFTER} s",
            len(gone),
            stuck_url,
            (f"gone: {_some(gone)}; " if gone else "") + f"{alive} heard from in the last minute",
            short="",
        ),
        Attention(
            "reconciler",
            "Reconciler not run in the last 5 minutes",
            int(late),
            stuck_url,
            "never heard from (is Celery beat running?)"
            if reconciler is None
            else f"last pass {int(reconciler)} s ago",
            short="",
        ),
    ]


def attention(user: Any) -> list[Attention]:
    """What needs an operator now, for the models ``user`` may view.

    Each count is the size of the changelist its link opens (the same filter).
    Shown on the admin index and on the app's index.
    """
    now = timezone.now()
    inbox = ProcessedMessage.objects.all()

    def changelist(model: type[Model], query: str) -> str:
        return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist") + query

    def may_view(model: type[Model]) -> bool:
        opts = model._meta
        return any(
            user.has_perm(f"{opts.app_label}.{perm}_{opts.model_name}")
            for perm in ("view", "change")
        )

    lines: list[Attention] = []
    if may_view(ProcessedMessage):
        lines += [
            Attention(
                "stuck",
                "Stuck in processing (lease expired)",
                inbox.filter(status=InboxStatus.PROCESSING, lease_expires_at__lt=now).count(),
                changelist(ProcessedMessage, "?attention=stuck"),
                short="stuck",
            ),
            Attention(
                "failed",
                "Failed, waiting for an operator",
                inbox.filter(status=InboxStatus.FAILED).count(),
                changelist(ProcessedMessage, "?attention=failed"),
                short="failed",
            ),
            Attention(
                "inbox_dead",
                "Dead (requeue once the cause is fixed)",
                inbox.filter(status=InboxStatus.DEAD).count(),
                changelist(ProcessedMessage, "?attention=dead"),
                short="dead",
            ),
            Attention(
                "refund",
                "Money to give back (a payment that cannot apply)",
                inbox.filter(status=InboxStatus.REJECTED, error__endswith=REFUND).count(),
                changelist(ProcessedMessage, "?attention=refund"),
                short="money to give back",
            ),
            Attention(
                "rejected_today",
                "Rejected today",
                inbox.filter(
                    status=InboxStatus.REJECTED, created_at__gte=_start_of_today()
                ).count(),
                changelist(ProcessedMessage, "?attention=rejected_today"),
            ),
        ]
        lines += _liveness_lines(changelist(ProcessedMessage, "?attention=stuck"))
    if may_view(ParkedMessage):
        held = ParkedMessage.objects.filter(parked_at__lte=_held_cutoff())
        oldest = held.order_by("parked_at").values_list("parked_at", flat=True).first()
        lines += [
            Attention(
                "held",
                f"Held longer than {_minutes(conf.PARKED_ATTENTION_AFTER)} (parked)",
                held.count(),
                changelist(ParkedMessage, "?attention=held"),
                f"oldest held {timesince(oldest, now)}" if oldest else "",
                short="held too long",
            ),
            Attention(
                "overdue",
                "Parked longer than PARKED_TIMEOUT",
                ParkedMessage.objects.filter(
                    Q(overdue_at__isnull=False) | Q(parked_at__lte=_overdue_cutoff())
                ).count(),
                changelist(ParkedMessage, "?attention=overdue"),
            ),
        ]
    if may_view(OutboxMessage):
        stats = outbox_stats()
        age = stats["oldest_pending_age"]
        lines.append(
            Attention(
                "outbox_pending",
                "Outbox pending",
                stats["pending"],
                changelist(OutboxMessage, f"?status__exact={OutboxStatus.PENDING}"),
                f"oldest waiting {timesince(now - timedelta(seconds=age), now)}" if age else "",
            )
        )
        lines.append(
            Attention(
                "outbox_dead",
                "Outbox dead letters (requeue once the cause is fixed)",
                stats["dead"],
                changelist(OutboxMessage, f"?status__exact={OutboxStatus.DEAD}"),
                short="outbox dead",
            )
        )
    return lines


@admin.display(description="reason")
def _reason(obj: ProcessedMessage) -> str:
    """The whole reason, wrapped: read without scrolling sideways."""
    if not obj.error:
        return ""
    return format_html('<div class="io-reason">{}</div>', obj.error)


@admin.display(description="held because (now)")
def _held_now(obj: ParkedMessage) -> str:
    """Why it waits, judged against the order as it is now (not the stored text)."""
    _, why = held_reason(obj)
    return format_html('<div class="io-reason">{}</div>', why)


def _timestamp(name: str, description: str) -> Any:
    @admin.display(description=description, ordering=name)
    def show(obj: Model) -> str:
        return at(getattr(obj, name))

    show.__name__ = f"{name}_s"
    return show


@admin.display(description="waiting")
def _waiting(obj: ParkedMessage) -> str:
    return timesince(obj.parked_at) if obj.parked_at else ""


@admin.display(description="order", ordering="order_id")
def _order(obj: ProcessedMessage | ParkedMessage) -> str:
    """The order, linked to its change page in the admin of the configured order model."""
    if obj.order_id is None:
        return "-"
    opts = get_order_model()._meta
    try:
        link = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.order_id])
    except NoReverseMatch:  # the order model has no admin
        return str(obj.order_id)
    return format_html('<a href="{}">{}</a>', link, obj.order_id)


# -- the order form: optimistic concurrency, message-owned fields read-only ------------------

#: Kept by the machinery on every order model (``AbstractOrder``); never typed by an operator.
MACHINERY_FIELDS = ("version", "last_seq", "has_parked")
#: Columns the built-in message types write, where the order model has them.
MESSAGE_COLUMNS = ("payment_id", "tracking_number", "carrier")


def _has_field(model: type[Model], name: str) -> bool:
    return any(f.name == name for f in model._meta.concrete_fields)


def _snapshot(order: Model) -> dict[str, str]:
    """The order's columns as text, to tell later what changed under an open form."""
    return {
        f.name: f.value_to_string(order)
        for f in type(order)._meta.concrete_fields
        if not f.primary_key and not getattr(f, "auto_now", False)
    }


def _changed_since(seen: str, order: Model) -> list[str]:
    try:
        before = json.loads(seen)
    except ValueError:
        before = {}
    now = _snapshot(order)
    return [name for name, value in now.items() if before.get(name) != value] or ["version"]


class StaleOrder(Exception):
    """The order's version moved between the form's check and its UPDATE."""


class OrderChangeForm(forms.ModelForm):
    """The order as the operator saw it travels with the form: its version and its values.

    A save whose version is no longer the row's changes nothing and names the
    fields that changed meanwhile (a message applied, another operator saved).
    The admin builds it for whichever order model it edits (no ``Meta.model``).
    """

    seen_version = forms.IntegerField(widget=forms.HiddenInput, min_value=0)
    seen = forms.CharField(widget=forms.HiddenInput, required=False)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["seen_version"].initial = self.instance.version
        self.fields["seen"].initial = json.dumps(_snapshot(self.instance), sort_keys=True)

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        seen_version = cleaned.get("seen_version")
        # Locked until the admin's transaction commits: a message waits for the
        # save instead of landing between this check and the UPDATE.
        model = type(self.instance)
        current = model._default_manager.select_for_update().filter(pk=self.instance.pk).first()
        if current is None or seen_version is None or current.version == seen_version:
            return cleaned
        changed = _changed_since(cleaned.get("seen", ""), current)
        # The form shown again carries the new version: saving it again is a
        # decision taken with the new values in view, not a blind overwrite.
        data = self.data.copy()  # type: ignore[attr-defined]
        data["seen_version"] = str(current.version)
        data["seen"] = json.dumps(_snapshot(current), sort_keys=True)
        self.data = data
        raise forms.ValidationError(
            "This order changed since you opened it (v%(was)s -> v%(now)s: %(changed)s). "
            "Nothing was saved. The page shows the current values; save again to keep "
            "your changes on top of them.",
            code="stale",
            params={"was": seen_version, "now": current.version, "changed": ", ".join(changed)},
        )


def _touched(order: Model) -> bool:
    """A message, parked or in the inbox, refers to the order: it is evidence, not a mistake."""
    if not isinstance(order, get_order_model()):
        return False  # messages refer to the configured order model only
    return (
        ProcessedMessage.objects.filter(order_id=order.pk).exists()
        or ParkedMessage.objects.filter(order_id=order.pk).exists()
    )


# -- transition actions: confirm, check the rules, report per order -------------------------


class Rule(enum.Enum):
    """How the admin may drive a declared transition."""

    #: The operator's own decision with no effect outside the database.
    OPERATOR = "operator"
    #: Applies a message the inbox refused, once its reason is fixed (its payload
    #: validates against the order now); without such a message it is refused.
    REPLAY = "replay"
    #: An effect outside the database: through the leased fulfilment step only.
    LEASED = "leased"


def transition_rule(
    model: type[Model], name: str, operator_transitions: Iterable[str] = ("cancel", "expire")
) -> Rule | None:
    """The rule for transition ``name`` of ``model``: the fulfilment step's is LEASED,
    ``operator_transitions`` are OPERATOR, one a registered message type drives is
    REPLAY; any other is refused (None).
    """
    if name == fulfilment.transition(model):
        return Rule.LEASED
    if name in operator_transitions:
        return Rule.OPERATOR
    return Rule.REPLAY if _message_types(name) else None


def _message_types(name: str) -> list[str]:
    return [h.message_type for h in registered() if h.transition == name]


def _label(model: type[Model], state: str) -> str:
    return str(dict(state_field(model).flatchoices).get(state, state))


def _verb(name: str) -> str:
    return name.replace("_", " ")


def action_label(model: type[Model], e: Edge, rule: Rule | None) -> str:
    """``Mark as shipped``: what an operator reads in the action menu."""
    if rule is Rule.LEASED:
        return f"Start fulfilment (asks the warehouse, marks as {_label(model, e.target)})"
    return f"Mark as {_label(model, e.target)}"


@dataclass
class Plan:
    """What one transition action will do to one order, in words."""

    order: Model
    #: ``apply``, or the audit result of doing nothing (``at_target``, ``refused``, ...).
    result: str
    text: str
    fields: dict[str, Any] = field(default_factory=dict)
    #: For the audit: the inbox message a replay applies.
    evidence: str = ""

    @property
    def applies(self) -> bool:
        return self.result == "apply"

    @property
    def state_label(self) -> str:
        """The order's state as read, in words (the confirmation page's "Now")."""
        return _label(type(self.order), current_state(self.order))


def _replayable(order: Model, name: str) -> tuple[dict[str, Any], str] | str:
    """The fields of a refused message that validates now, or why there is none."""
    types = _message_types(name)
    rows = ProcessedMessage.objects.filter(
        order_id=order.pk,
        message_type__in=types,
        status__in=[InboxStatus.REJECTED, InboxStatus.FAILED],
    ).order_by("-id")
    reason = (
        f"no {' or '.join(types)} message for it in the inbox; "
        f"only that message can {_verb(name)} it"
    )
    for row in rows:
        try:
            envelope = parse_envelope(json.loads(row.body), consumer=row.consumer)
            fields = envelope.handler.validate(order, envelope.payload)
        except (ValueError, InvalidMessage) as exc:
            why = exc.message if isinstance(exc, InvalidMessage) else "its body is not readable"
            reason = f"{row.message_type} {row.message_id} is still refused: {why}"
            continue
        return fields, f"{row.consumer}:{row.message_id}"
    return reason


def plan(order: Model, name: str, user: Any, rule: Rule | None) -> Plan:
    """Decide, without writing, what transition ``name`` under ``rule`` would do to ``order``
    for ``user``.
    """
    model = type(order)
    e = edge(model, name)
    state = current_state(order)
    status = classify(model, name, state)
    if status is TransitionStatus.AT_TARGET:
        return Plan(order, status.value, f"already {_label(model, state)}; nothing to do")
    if status is TransitionStatus.PAST_TARGET:
        return Plan(
            order,
            status.value,
            f"already past {_label(model, e.target)} ({_label(model, state)}); nothing to do",
        )
    if status is not TransitionStatus.APPLIED:
        return Plan(order, status.value, f"cannot {_verb(name)} from {_label(model, state)}")
    declared = getattr(model, name)._django_fsm.get_transition(state)
    if not declared.has_perm(order, user):
        return Plan(order, "forbidden", f"you may not {_verb(name)} it")
    failing = unmet_conditions(order, name)
    if failing:
        return Plan(
            order,
            TransitionStatus.NOT_ALLOWED.value,
            f"cannot {_verb(name)}: condition {', '.join(failing)} does not hold",
        )
    move = f"{_label(model, state)} -> {_label(model, e.target)}"
    if rule is Rule.OPERATOR:
        return Plan(order, "apply", move)
    if rule is Rule.LEASED:
        return Plan(order, "apply", f"{move} (the warehouse is asked, once)")
    if rule is Rule.REPLAY:
        found = _replayable(order, name)
        if isinstance(found, str):
            return Plan(order, "refused", found)
        fields, evidence = found
        extra = ", ".join(
            f"{k.removesuffix('_id').replace('_', ' ')} {v}" for k, v in fields.items()
        )
        return Plan(order, "apply", f"{move} ({extra})" if extra else move, fields, evidence)
    return Plan(order, "refused", f"the admin has no rule to {_verb(name)} orders")


def _fulfil(p: Plan) -> tuple[str, str]:
    """Run the leased fulfilment step for ``p.order``: (audit result, words)."""
    result = fulfilment.fulfil(p.order.pk)
    row = ProcessedMessage.objects.filter(
        consumer=fulfilment.CONSUMER, message_id=fulfilment.fulfilment_message_id(p.order.pk)
    ).first()
    where = f"Processed messages: {row.consumer}:{row.message_id}" if row else "Processed messages"
    if result is Outcome.APPLIED:
        return result.value, p.text
    if result is StepResult.RETRY:
        return result.value, (
            f"the warehouse call failed; the reconciler tries again (or Retry it in {where})"
        )
    if result is StepResult.FAILED:
        return result.value, f"fulfilment failed and waits for an operator in {where}"
    if row is not None and row.status == InboxStatus.PROCESSING:
        return result.value, f"fulfilment is already under way ({where})"
    return result.value, f"nothing done: {row.error if row else result.value}"


def _run(p: Plan, name: str, rule: Rule | None) -> tuple[str, str]:
    """Carry a plan out: (audit result, words)."""
    if rule is Rule.LEASED:
        return _fulfil(p)
    result = apply_transition(p.order, name, fields=p.fields)
    if result.status is TransitionStatus.CONFLICT:
        return result.status.value, "changed while you looked at it; nothing done — review it again"
    if not result.applied:
        return (
            result.status.value,
            f"cannot {_verb(name)} from {_label(type(p.order), result.source)}",
        )
    return result.status.value, p.text


def _drawable_edges(model: type[Model]) -> list[Edge]:
    """The transitions the admin offers as actions: those with one declared target state.

    One whose target its body picks (fsm-2's ``RETURN_VALUE``, ``GET_STATE``) or
    that has none (``target=None``) has no "Mark as ..." to offer; a model whose
    graph cannot be read (no single state field) gives none. Never a crash.
    """
    try:
        return [e for e in edges(model) if e.target is not None]
    except UnknownTransition:
        return []


def _transition_action(model: type[Model], e: Edge) -> Callable[..., Any]:
    name = e.name
    label = action_label(model, e, transition_rule(model, name))

    def action(
        modeladmin: OrderAdminMixin, request: HttpRequest, queryset: QuerySet[Any]
    ) -> TemplateResponse | None:
        rule = modeladmin.get_transition_rule(name)
        plans = [plan(order, name, request.user, rule) for order in queryset]
        if request.POST.get("post") != "yes":
            return TemplateResponse(
                request,
                "admin/idempotent_orders/order/transition_confirmation.html",
                {
                    **modeladmin.admin_site.each_context(request),
                    "title": f"{label}: are you sure?",
                    "subtitle": None,
                    "opts": modeladmin.opts,
                    "action": f"transition_{name}",
                    "label": label,
                    "description": inspect.getdoc(getattr(model, name)) or "",
                    "plans": plans,
                    "applicable": any(p.applies for p in plans),
                    "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                    "next": _next_url(request),
                },
            )
        for p in plans:
            order = p.order
            version = order.version  # type: ignore[attr-defined]
            confirmed = request.POST.get(f"version-{order.pk}")
            if not p.applies:
                result, text, level = p.result, p.text, messages.WARNING
                if p.result in {"at_target", "past_target"}:
                    level = messages.INFO
            elif confirmed != str(version):
                result, level = TransitionStatus.CONFLICT.value, messages.WARNING
                text = (
                    f"changed since you confirmed (v{confirmed} -> v{version}); "
                    "nothing done — review it again"
                )
            else:
                result, text = _run(p, name, rule)
                level = messages.SUCCESS if result in {"applied"} else messages.WARNING
            detail = f"{current_state(order)} v{order.version}: {text}"  # type: ignore[attr-defined]
            if p.evidence:
                detail += f"; from inbox message {p.evidence}"
            audit(request, f"transition:{name}", order, result, detail)
            messages.add_message(request, level, f"Order {order.pk}: {text}")
        _tell_what_is_left(request)
        return None

    action.__name__ = f"transition_{name}"
    return admin.action(description=label, permissions=["change"])(action)


# -- the order admin: a mixin for any order model, registered for the default one -----------

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Model]
else:
    _ModelAdmin = object


class OrderAdminMixin(_ModelAdmin):
    """The admin's guarantees for an order model; put it first on your own ``ModelAdmin``.

    Like ``UserAdmin`` for ``auth.User``, :class:`OrderAdmin` is registered only
    for the default ``idempotent_orders.Order``. A project with its own order
    model (``IDEMPOTENT_ORDERS_ORDER_MODEL``) registers it with this mixin::

        @admin.register(Order)
        class OrderAdmin(OrderAdminMixin, admin.ModelAdmin):
            operator_transitions = ["void"]

    It brings the change form that carries the version it was opened at (a
    stale save changes nothing and names what changed), read-only state,
    ``version``, ``last_seq``, ``has_parked`` and :attr:`message_owned_fields`,
    one confirmed, audited action per declared transition (fsm-2
    ``permission=`` and ``conditions=`` honoured; rules in :func:`transition_rule`)
    and no deletion of an order a message refers to. Add ``fieldsets``,
    ``list_display`` and the rest as for any ``ModelAdmin``.
    """

    #: Columns only messages write, read-only in the form. None: those of
    #: ``payment_id``, ``tracking_number``, ``carrier`` the model has. The state
    #: field is always read-only too.
    message_owned_fields: Sequence[str] | None = None
    #: Set when the order is created (its business key): editable on the add form only.
    creation_fields: Sequence[str] = ("business_key",)
    #: Checked by a payment against the order: read-only once the order left its
    #: initial state (the state field's default). Those the model has.
    price_fields: Sequence[str] = ("amount", "currency")
    #: Transitions that are the operator's own decision (no money moved, no
    #: effect outside the database). Those the model declares.
    operator_transitions: Sequence[str] = ("cancel", "expire")
    #: The change form with the order's timeline under it (see :mod:`idempotent_orders.timeline`).
    #: A project with its own change form template includes
    #: ``admin/idempotent_orders/order/timeline.html`` in it.
    change_form_template = "admin/idempotent_orders/order/change_form.html"

    def get_timeline_outbox(self, obj: Any) -> QuerySet[OutboxMessage] | None:
        """The outbox rows of ``obj`` for its timeline; None: ``order_key`` is its id or key."""
        return None

    def __init__(self, model: type[Model], admin_site: admin.AdminSite) -> None:
        super().__init__(model, admin_site)
        transitions = [_transition_action(model, e) for e in _drawable_edges(model)]
        self.actions = [*(self.actions or ()), *transitions]

    # -- what the form may change --

    def _present(self, names: Iterable[str]) -> list[str]:
        return [n for n in names if _has_field(self.model, n)]

    def get_message_owned_fields(self) -> list[str]:
        """The state field and the columns messages write (:attr:`message_owned_fields`)."""
        state = state_field(self.model).name
        owned = (
            self.message_owned_fields
            if self.message_owned_fields is not None
            else self._present(MESSAGE_COLUMNS)
        )
        return [state, *(n for n in owned if n != state)]

    def get_operator_transitions(self) -> list[str]:
        return [n for n in self.operator_transitions if has_transition(self.model, n)]

    def get_transition_rule(self, name: str) -> Rule | None:
        return transition_rule(self.model, name, self.get_operator_transitions())

    def left_initial_state(self, obj: Model) -> bool:
        """Whether ``obj`` moved from its state field's default (a payment was checked)."""
        return current_state(obj) != str(state_field(self.model).get_default())

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        fixed = [*super().get_readonly_fields(request, obj)]
        fixed += self.get_message_owned_fields() + self._present(MACHINERY_FIELDS)
        if obj is not None:
            fixed += self._present(self.creation_fields)
            if self.left_initial_state(obj):
                fixed += self._present(self.price_fields)
        return list(dict.fromkeys(fixed))

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        own_layout = self.fieldsets is not None or self.fields is not None
        if obj is None:
            if own_layout:
                return fieldsets
            # Adding: what the operator types; the state and counters start at their defaults.
            fixed = set(self.get_readonly_fields(request, obj))
            return [(None, {"fields": [f for f in flatten_fieldsets(fieldsets) if f not in fixed]})]
        shown = set(flatten_fieldsets(fieldsets))
        hidden = [f for f in ("seen_version", "seen") if f not in shown]
        if own_layout:
            return [*fieldsets, (None, {"fields": hidden})] if hidden else fieldsets
        # No layout of the project's own: key, state and version first, then what
        # the operator may change, then what messages wrote.
        state = state_field(self.model).name
        names = [f for f in flatten_fieldsets(fieldsets) if f not in ("seen_version", "seen")]
        owned = [*self.get_message_owned_fields(), "last_seq", "has_parked"]
        written = [f for f in names if f in owned and f != state]
        head = [f for f in (*self.creation_fields, state, "version") if f in names]
        rest = [f for f in names if f not in head and f not in written]
        layout: list[Any] = [(None, {"fields": head + rest})]
        if written:
            layout.append(("Written by messages", {"fields": written}))
        return [*layout, (None, {"fields": ["seen_version", "seen"]})]

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        if obj is not None and "form" not in kwargs:  # adding: no version to carry yet
            form = self.form
            if not issubclass(form, OrderChangeForm):
                form = type(f"Versioned{form.__name__}", (OrderChangeForm, form), {})
            kwargs["form"] = form
        return super().get_form(request, obj, change, **kwargs)

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        if not change:
            super().save_model(request, obj, form, change)
            return
        seen_version = form.cleaned_data["seen_version"]
        columns = {f.name for f in self.model._meta.concrete_fields}
        values = {f: form.cleaned_data[f] for f in form.changed_data if f in columns}
        if not values:
            return
        # The same optimistic lock as every transition: WHERE version = what the form showed.
        rows = self.model._default_manager.filter(pk=obj.pk, version=seen_version).update(
            **written_values(self.model, values), version=F("version") + 1
        )
        if rows != 1:
            raise StaleOrder(form.cleaned_data.get("seen", ""))
        obj.version = seen_version + 1

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        if object_id is not None:
            obj = self.get_object(request, object_id)
            if obj is not None:
                extra_context = {
                    **(extra_context or {}),
                    "timeline": timeline(obj, outbox=self.get_timeline_outbox(obj)),
                }
        try:
            return super().changeform_view(request, object_id, form_url, extra_context)
        except StaleOrder as exc:  # the admin's transaction was rolled back: nothing saved
            current = (
                self.model._default_manager.filter(pk=object_id).first() if object_id else None
            )
            changed = _changed_since(str(exc), current) if current else ["the order was deleted"]
            self.message_user(
                request,
                f"This order changed while it was being saved ({', '.join(changed)}). "
                "Nothing was saved; make your change again on the current values.",
                messages.ERROR,
            )
            return HttpResponseRedirect(request.get_full_path())

    # Orders that messages refer to are evidence: deleting one would detach its
    # inbox rows (a redelivered message then finds an "unknown order") and
    # delete its parked messages. Only an order no message touched is deletable.
    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        if obj is not None and _touched(obj):
            return False
        return super().has_delete_permission(request, obj)

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> Any:
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        for order in objs:
            if _touched(order):
                protected.append(f"{order}: messages refer to it (inbox or parked)")
        return deleted, counts, perms_needed, protected

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        # Locked and checked again: a message may have arrived since the confirmation.
        with transaction.atomic():
            for order in queryset.select_for_update():
                if _touched(order):
                    audit(request, "order:delete", order, "skipped", "messages refer to it")
                else:
                    audit(request, "order:delete", order, "deleted")
                    order.delete()


class OrderAdmin(OrderAdminMixin, admin.ModelAdmin):
    """The admin of the default ``idempotent_orders.Order``."""

    list_display = ["id", "status", "version", "last_seq", "amount", "currency", "updated_at"]
    list_filter = ["status", "currency"]
    search_fields = ["business_key", "payment_id", "tracking_number"]
    readonly_fields = ["created_at", "updated_at"]

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is None:
            return [(None, {"fields": ["business_key", "customer", "amount", "currency"]})]
        return [
            (
                None,
                {"fields": ["business_key", "status", "version", "customer", "amount", "currency"]},
            ),
            (
                "Written by messages",
                {"fields": ["payment_id", "tracking_number", "carrier", "last_seq", "has_parked"]},
            ),
            (None, {"fields": ["created_at", "updated_at", "seen_version", "seen"]}),
        ]


# The admin's own index shows the attention dashboard too, unless the project set
# an index template of its own (it can add {% attention_dashboard %} to it).
if admin.site.index_template is None:
    admin.site.index_template = "admin/idempotent_orders/index.html"

# Like UserAdmin for auth.User: only the default model gets this admin. A project
# with its own order model registers it with OrderAdminMixin.
if get_order_model() is Order:
    admin.site.register(Order, OrderAdmin)


class MessageTypeFilter(admin.SimpleListFilter):
    """The registered message types (from the code, not a ``SELECT DISTINCT`` over the table)."""

    title = "message type"
    parameter_name = "message_type"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(h.message_type, h.message_type) for h in registered()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(message_type=value) if value else queryset


class ConsumerFilter(admin.SimpleListFilter):
    """The consumers the registered message types name (``register(consumers=...)``);
    hidden when none does. Any consumer is still one ``?consumer=<name>`` away."""

    title = "consumer"
    parameter_name = "consumer"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        names = sorted({c for h in registered() for c in h.consumers})
        return [(name, name) for name in names]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(consumer=value) if value else queryset


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


class KeySearchMixin(admin.ModelAdmin):
    """Search a big table the way its indexes answer: each term equals (``=``, no
    ``LIKE``, no ``UPPER()``) one of the text keys ``key_search_text``, or the primary
    key of the row a foreign key of ``key_search_related`` points at, when the term is
    one (a whole number for an integer key: compared as a number, not cast to text).
    ``search_fields`` only shows the search box."""

    key_search_text: tuple[str, ...] = ("message_id",)
    key_search_related: tuple[str, ...] = ()
    search_help_text = "An exact message id or order id."
    #: No COUNT(*) over the whole table on each page.
    show_full_result_count = False

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        from django.utils.text import smart_split, unescape_string_literal

        for bit in smart_split(search_term):
            if bit.startswith(('"', "'")) and bit[0] == bit[-1]:
                bit = unescape_string_literal(bit)
            match = Q.create([(name, bit) for name in self.key_search_text], connector=Q.OR)
            for name in self.key_search_related:
                relation: Any = self.opts.get_field(name)
                value = _as_key(relation.target_field, bit)
                if value is not None:
                    match |= Q(**{relation.attname: value})
            queryset = queryset.filter(match)
        return queryset, False


def _as_key(field: Any, term: str) -> Any:
    """``term`` as a value of the key ``field``; None when it cannot be one."""
    from django.core.exceptions import ValidationError
    from django.db.models import IntegerField

    if isinstance(field, IntegerField) and not (term.isascii() and term.isdigit()):
        return None
    if isinstance(field, IntegerField) and len(term) > 18:
        return None  # past a bigint
    try:
        return field.to_python(term)
    except (ValidationError, ValueError, TypeError):
        return None


class EvidenceAdmin(admin.ModelAdmin):
    """Rows that are the record of what happened: never added or deleted from the admin."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Without the delete permission Django leaves "delete selected" out of
        # the actions too (the action declares allowed_permissions=("delete",)).
        return False


class ReadOnlyEvidenceAdmin(EvidenceAdmin):
    """View-only: saving a form would write back every column as it was read."""

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


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
    list_display = [
        "message_id",
        "consumer",
        "message_type",
        "outcome",
        "status",
        _order,
        "seq",
        _timestamp("created_at", "created at"),
        "attempts",
        _timestamp("lease_expires_at", "lease expires at"),
        _timestamp("dead_at", "dead at"),
        _reason,
        _fix,
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
        back = _next_url(request) or reverse(
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
        return _requeue_dead(
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


@admin.register(ParkedMessage)
class ParkedMessageAdmin(KeySearchMixin, ReadOnlyEvidenceAdmin):
    list_display = [
        "message_id",
        "consumer",
        _order,
        "seq",
        _held_now,
        _timestamp("parked_at", "parked at"),
        _waiting,
        _timestamp("overdue_at", "overdue at"),
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
        _timestamp("created_at", "at"),
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
        return _requeue_dead(
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


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(ReadOnlyEvidenceAdmin):
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


def _requeue_dead(
    model_admin: admin.ModelAdmin[Any],
    request: HttpRequest,
    queryset: QuerySet[Any],
    *,
    what: str,
    dead: str,
    requeue: Callable[..., int],
    who: tuple[str, Callable[[Any], str]],
    error: Callable[[Any], str],
) -> TemplateResponse | None:
    """The "requeue dead rows" action of the inbox and the outbox admins.

    Confirm first (the model's ``requeue_confirmation.html``); then each dead
    row is requeued by ``requeue(ids=[pk])``, conditional on its still being
    dead, and audited one by one as ``<what>:requeue``.
    """
    rows = list(queryset.order_by("id"))
    opts = model_admin.opts
    if request.POST.get("post") != "yes":
        label, name = who
        return TemplateResponse(
            request,
            f"admin/{opts.app_label}/{opts.model_name}/requeue_confirmation.html",
            {
                **model_admin.admin_site.each_context(request),
                "title": f"Requeue dead {what} rows: are you sure?",
                "subtitle": None,
                "opts": opts,
                "rows": rows,
                "plan": [(row, name(row), error(row)) for row in rows],
                "who_label": label,
                "dead": [r for r in rows if r.status == dead],
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                "next": _next_url(request),
            },
        )
    results: Counter[str] = Counter()
    for row in rows:
        # Conditional on the row still being dead: a row requeued meanwhile is skipped.
        done = requeue(ids=[row.pk], using=queryset.db)
        result = "requeued" if done else "skipped"
        results[result] += 1
        detail = (
            f"dead after {row.attempts} attempt(s): {error(row)}"
            if done
            else f"not dead ({row.status}); nothing done"
        )
        if done:
            before = error(row)
            row.refresh_from_db()
            detail += f"; now {row.status}"
            if error(row) and error(row) != before:
                detail += f": {error(row)}"
        audit(request, f"{what}:requeue", row, result, detail)
        which = f"{row.message_id}" + (
            f" (order {row.order_id})" if getattr(row, "order_id", None) is not None else ""
        )
        model_admin.message_user(
            request,
            f"Requeue {which}: {detail}.",
            messages.SUCCESS if done else messages.WARNING,
        )
    level = messages.SUCCESS if not results["skipped"] else messages.WARNING
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(results.items()))
    model_admin.message_user(request, f"Requeue: {summary or 'nothing selected'}.", level)
    _tell_what_is_left(request)
    return None
