"""The order admin's "Mark as ..." actions: one per declared transition with a target state.

Each first shows a confirmation page listing every selected order, its state and what
will happen (:func:`plan`); the rules (:class:`Rule`, :func:`transition_rule`) say
which transitions the operator decides, which only replay a refused message and which
go through the leased fulfilment step. Every run is audited and reported per order.
"""

from __future__ import annotations

import enum
import inspect
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import Model, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from idempotent_orders import fulfilment
from idempotent_orders.admin.common import audit, next_url
from idempotent_orders.admin.dashboard import tell_what_is_left
from idempotent_orders.consuming.graph import (
    Edge,
    TransitionStatus,
    classify,
    current_state,
    edge,
    edges,
    state_field,
    unmet_conditions,
)
from idempotent_orders.consuming.registry import registered
from idempotent_orders.consuming.running import apply_transition
from idempotent_orders.consuming.single import parse_envelope
from idempotent_orders.exceptions import InvalidMessage, UnknownTransition
from idempotent_orders.leases import StepResult
from idempotent_orders.models import (
    InboxStatus,
    Outcome,
    ProcessedMessage,
)


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


def _targets(model: type[Model], e: Edge) -> str:
    """The states a transition may end in, in words: ``refund payment or order canceled``."""
    if e.target is not None:
        return _label(model, e.target)
    return " or ".join(sorted(_label(model, t) for t in e.targets))


def action_label(model: type[Model], e: Edge, rule: Rule | None) -> str:
    """``Mark as shipped``: what an operator reads in the action menu; for a transition
    whose body picks the target, its name and the targets it may pick."""
    if rule is Rule.LEASED:
        return f"Start fulfilment (asks the warehouse, marks as {_label(model, e.target)})"
    if e.target is None:
        return f"{_verb(e.name).capitalize()} (ends as {_targets(model, e)})"
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
            f"already past {_targets(model, e)} ({_label(model, state)}); nothing to do",
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
    move = f"{_label(model, state)} -> {_targets(model, e)}"
    if e.target is None:
        move += " (its body decides)"
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
    model = type(p.order)
    if edge(model, name).target is None:
        # The body picked the target: say the one it picked, not the choice offered.
        return result.status.value, (
            f"{_label(model, result.source)} -> {_label(model, result.target)}"
        )
    return result.status.value, p.text


def drawable_edges(model: type[Model], operator: Iterable[str] = ()) -> list[Edge]:
    """The transitions the admin offers as actions: those with one declared target state,
    and the ``operator`` transitions whose body picks the target among several (fsm-2's
    ``RETURN_VALUE``, ``GET_STATE``: django-SHOP's ``cancel_order``), whose confirmation
    page names the states they may end in.

    A targetless transition (``target=None``) has no action to offer; a model whose
    graph cannot be read (no single state field) gives none. Never a crash.
    """
    chosen = set(operator)
    try:
        return [
            e
            for e in edges(model)
            if e.target is not None or (e.dynamic and not e.targetless and e.name in chosen)
        ]
    except UnknownTransition:
        return []


class TransitionAdmin(Protocol):
    """What a transition's action needs of the order admin running it
    (:class:`~idempotent_orders.admin.orders.OrderAdminMixin` is one)."""

    admin_site: admin.AdminSite
    opts: Any

    def get_transition_rule(self, name: str) -> Rule | None: ...


def transition_action(model: type[Model], e: Edge) -> Callable[..., Any]:
    name = e.name
    label = action_label(model, e, transition_rule(model, name))

    def action(
        modeladmin: TransitionAdmin, request: HttpRequest, queryset: QuerySet[Any]
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
                    "next": next_url(request),
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
        tell_what_is_left(request)
        return None

    action.__name__ = f"transition_{name}"
    return admin.action(description=label, permissions=["change"])(action)
