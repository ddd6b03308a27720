"""What the admin's lists and actions share: the audit trail, the way back after a
confirmation, the timestamp and order columns, the evidence admins' base classes
(never added or deleted), key search, the consumer filter and "requeue dead rows".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import Model, Q, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html
from django.utils.http import url_has_allowed_host_and_scheme

from idempotent_orders import get_order_model
from idempotent_orders.admin.dashboard import tell_what_is_left
from idempotent_orders.consuming.registry import registered
from idempotent_orders.models import (
    AuditEntry,
    OutboxMessage,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.paginators import EstimatedCountPaginator
from idempotent_orders.timeline import at


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
    """Record one operator action on ``obj``, naming its order and message (searchable),
    and beside it Django's own ``LogEntry``, so the admin's "Recent actions" lists it."""
    from django.contrib.admin.models import CHANGE, LogEntry

    user = request.user if request.user.is_authenticated else None
    order_pk, message_id = _names(obj)
    if user is not None:
        LogEntry.objects.log_actions(
            user.pk, [obj], CHANGE, f"{action}: {result}. {detail}"[:2000], single_object=True
        )
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


def next_url(request: HttpRequest) -> str:
    """Where to go once a one-row confirmation is done: the page the operator came from."""
    wanted = request.POST.get("next") or request.GET.get("next") or ""
    if wanted and url_has_allowed_host_and_scheme(
        wanted, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return wanted
    return ""


def timestamp(name: str, description: str) -> Any:
    """A list column showing the datetime ``name`` as the timeline writes it, sortable."""

    @admin.display(description=description, ordering=name)
    def show(obj: Model) -> str:
        return at(getattr(obj, name))

    show.__name__ = f"{name}_s"
    return show


@admin.display(description="order", ordering="order_id")
def order_link(obj: ProcessedMessage | ParkedMessage) -> str:
    """The order, linked to its change page in the admin of the configured order model."""
    if obj.order_id is None:
        return "-"
    opts = get_order_model()._meta
    try:
        link = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.order_id])
    except NoReverseMatch:  # the order model has no admin
        return str(obj.order_id)
    return format_html('<a href="{}">{}</a>', link, obj.order_id)


def known_consumers() -> list[str]:
    """Every consumer the code writes inbox rows for, read from the code (not a ``SELECT
    DISTINCT`` over the table): the app's Celery consumers, the ones the registered message
    types name, the leased steps' and the webhook providers'."""
    from idempotent_orders import leases
    from idempotent_orders.tasks import CONSUMERS
    from idempotent_orders.webhooks.config import providers

    names = set(CONSUMERS) | {c for h in registered() for c in h.consumers}
    names |= set(leases.step_consumers()) | {p.consumer for p in providers()}
    return sorted(names)


class ConsumerFilter(admin.SimpleListFilter):
    """Every consumer the code writes rows for (:func:`known_consumers`). Any other
    consumer is still one ``?consumer=<name>`` away."""

    title = "consumer"
    parameter_name = "consumer"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in known_consumers()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(consumer=value) if value else queryset


class KeySearchMixin(admin.ModelAdmin):
    """Search a big table the way its indexes answer: each term equals (``=``, no
    ``LIKE``, no ``UPPER()``) one of the text keys ``key_search_text``, or the primary
    key of the row a foreign key of ``key_search_related`` points at, when the term is
    one (a whole number for an integer key: compared as a number, not cast to text).
    ``search_fields`` only shows the search box."""

    key_search_text: tuple[str, ...] = ("message_id",)
    key_search_related: tuple[str, ...] = ()
    search_help_text = "An exact message id or order id."
    #: No COUNT(*) over the whole table on each page, nor over a large filtered set.
    show_full_result_count = False
    paginator = EstimatedCountPaginator

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


def requeue_dead_rows(
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
                "next": next_url(request),
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
    tell_what_is_left(request)
    return None
