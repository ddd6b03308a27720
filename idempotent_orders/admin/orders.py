"""The order admin: :class:`OrderAdminMixin` for any order model, :class:`OrderAdmin`
registered for the default one, and :class:`OrderChangeForm`, the change form that
carries the version it was opened at (a stale save changes nothing).

The change page shows the order's timeline (:mod:`idempotent_orders.timeline`); the
transition actions come from :mod:`idempotent_orders.admin.order_actions`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import flatten_fieldsets
from django.db import transaction
from django.db.models import F, Model, Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect

from idempotent_orders import get_order_model
from idempotent_orders.admin.common import audit
from idempotent_orders.admin.order_actions import (
    Rule,
    drawable_edges,
    transition_action,
    transition_rule,
)
from idempotent_orders.consuming.graph import (
    current_state,
    has_transition,
    state_field,
)
from idempotent_orders.consuming.running import written_values
from idempotent_orders.models import (
    Order,
    OutboxMessage,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.paginators import EstimatedCountPaginator
from idempotent_orders.timeline import timeline

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


# -- the order admin: a mixin for any order model, registered for the default one -----------

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Model]
else:
    _ModelAdmin = object


#: The text lookups a search field may end with (an order number is compared exactly).
_TEXT_LOOKUPS = (
    "__exact",
    "__iexact",
    "__contains",
    "__icontains",
    "__startswith",
    "__istartswith",
)


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

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        """An order number ("12" or "#12") finds that order, and the orders one of the
        search fields equals exactly: not every key that merely contains the digits."""
        term = search_term.strip().removeprefix("#")
        if not (term.isascii() and term.isdigit() and len(term) <= 18):
            return super().get_search_results(request, queryset, search_term)
        match = Q(pk=int(term))
        for name in self.get_search_fields(request):
            path = name.lstrip("^=@")
            for lookup in _TEXT_LOOKUPS:
                path = path.removesuffix(lookup)
            match |= Q(**{f"{path}__exact": term})
        return queryset.filter(match), False

    #: An order table grows without bound: no unfiltered total beside each page, and a
    #: count that stops at 10,000 rows (an estimate past them on PostgreSQL).
    show_full_result_count = False
    paginator = EstimatedCountPaginator

    def get_timeline_outbox(self, obj: Any) -> QuerySet[OutboxMessage] | None:
        """The outbox rows of ``obj`` for its timeline; None: ``order_key`` is its id or key."""
        return None

    def __init__(self, model: type[Model], admin_site: admin.AdminSite) -> None:
        super().__init__(model, admin_site)
        operator = [n for n in self.operator_transitions if has_transition(model, n)]
        transitions = [transition_action(model, e) for e in drawable_edges(model, operator)]
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


class CurrencyFilter(admin.SimpleListFilter):
    """The currencies of the latest orders, read from the newest end of the primary key.
    Django's own filter of a field's values is a ``SELECT DISTINCT`` over every order
    (0.56 s at 2M orders); any other currency is still one ``?currency=XYZ`` away."""

    title = "currency"
    parameter_name = "currency"
    #: How many of the newest orders the choices come from.
    recent = 1000

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        newest = model_admin.get_queryset(request).order_by("-pk")[: self.recent]
        return [(c, c) for c in sorted(set(newest.values_list("currency", flat=True)))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(currency=value) if value else queryset


class OrderAdmin(OrderAdminMixin, admin.ModelAdmin):
    """The admin of the default ``idempotent_orders.Order``."""

    list_display = ["id", "status", "version", "last_seq", "amount", "currency", "updated_at"]
    list_filter = ["status", CurrencyFilter]
    # Exact, on the unique index: a LIKE over the order table is a scan (2.2 s at 2M orders).
    search_fields = ["business_key__exact"]
    search_help_text = "An exact business key."
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


# Like UserAdmin for auth.User: only the default model gets this admin. A project
# with its own order model registers it with OrderAdminMixin.
if get_order_model() is Order:
    admin.site.register(Order, OrderAdmin)
