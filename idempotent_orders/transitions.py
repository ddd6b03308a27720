"""The conditional transition: django-fsm-2's graph, committed by one optimistic-lock UPDATE.

The graph is read from the ``@transition`` declarations on the model; nothing
here, or anywhere else in the project, writes a second copy of it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

from django.db import transaction
from django.db.models import F, Model
from django.utils import timezone
from django_fsm import ANY_OTHER_STATE, ANY_STATE, FSMFieldMixin
from django_fsm.signals import post_transition, pre_transition

from idempotent_orders.exceptions import UnknownTransition
from idempotent_orders.signals import order_transitioned


class TransitionStatus(enum.Enum):
    APPLIED = "applied"
    #: The order is at the transition's target already.
    AT_TARGET = "at_target"
    #: The order has moved past the target (the target lies upstream of its state).
    PAST_TARGET = "past_target"
    #: The target can still be reached, but not by this transition from the current state.
    LATER = "later"
    #: The target can never be reached from the current state.
    NOT_ALLOWED = "not_allowed"
    #: Someone else changed the row between our read and our UPDATE.
    CONFLICT = "conflict"


@dataclass(frozen=True)
class TransitionResult:
    status: TransitionStatus
    source: str
    target: str
    version: int

    @property
    def applied(self) -> bool:
        return self.status is TransitionStatus.APPLIED


@dataclass(frozen=True)
class Edge:
    """One declared transition: ``name`` moves ``sources`` to ``target``."""

    name: str
    sources: frozenset[str]
    target: str


@cache
def state_field(model: type[Model]) -> FSMFieldMixin:
    """The model's state ``FSMField``: its only one, or the one ``state_field_name`` names."""
    fields = [f for f in model._meta.concrete_fields if isinstance(f, FSMFieldMixin)]
    named = getattr(model, "state_field_name", None)
    if named:
        fields = [f for f in fields if f.name == named]
        if not fields:
            raise UnknownTransition(
                f"{model.__name__}.state_field_name names {named!r}, which is not an FSMField"
            )
    if len(fields) != 1:
        raise UnknownTransition(
            f"{model.__name__} must have exactly one FSMField, or name its state field "
            "in state_field_name"
        )
    return fields[0]


@cache
def _graph(model: type[Model]) -> tuple[dict[str, Edge], dict[str, frozenset[str]]]:
    """Edges by method name, and the states reachable from each state, from the fsm meta."""
    field = state_field(model)
    all_states = {str(value) for value, _ in field.flatchoices}
    edges: dict[str, Edge] = {}
    for name, method in field.transitions[model].items():
        meta = method._django_fsm
        targets = {t.target for t in meta.transitions.values()}
        if len(targets) != 1 or None in targets:
            raise UnknownTransition(f"{model.__name__}.{name} must have one concrete target")
        (target,) = targets
        sources: set[str] = set()
        for source in meta.transitions:
            if source == ANY_STATE:
                sources |= all_states
            elif source == ANY_OTHER_STATE:
                sources |= all_states - {target}
            else:
                sources.add(str(source))
        edges[name] = Edge(name=name, sources=frozenset(sources), target=str(target))

    successors: dict[str, set[str]] = {state: set() for state in all_states}
    for edge in edges.values():
        for source in edge.sources:
            successors.setdefault(source, set()).add(edge.target)
    reachable: dict[str, frozenset[str]] = {}
    for state in successors:
        seen: set[str] = set()
        stack = list(successors[state])
        while stack:
            nxt = stack.pop()
            if nxt not in seen:
                seen.add(nxt)
                stack.extend(successors.get(nxt, ()))
        reachable[state] = frozenset(seen)
    return edges, reachable


def edge(model: type[Model], name: str) -> Edge:
    """The declared transition called ``name`` on ``model``."""
    edges, _ = _graph(model)
    try:
        return edges[name]
    except KeyError:
        raise UnknownTransition(f"{model.__name__}.{name} is not a transition") from None


def has_transition(model: type[Model], name: str) -> bool:
    """Whether ``model`` declares an ``@transition`` called ``name`` on its state field."""
    return name in _graph(model)[0]


def edges(model: type[Model]) -> Iterable[Edge]:
    return _graph(model)[0].values()


def reachable_from(model: type[Model], state: str) -> frozenset[str]:
    """States that some sequence of declared transitions leads to from ``state``."""
    return _graph(model)[1].get(state, frozenset())


def classify(model: type[Model], name: str, current: str) -> TransitionStatus:
    """Where ``current`` stands relative to transition ``name``, without touching the database."""
    e = edge(model, name)
    if current in e.sources:
        return TransitionStatus.APPLIED
    if current == e.target:
        return TransitionStatus.AT_TARGET
    if current in reachable_from(model, e.target):
        return TransitionStatus.PAST_TARGET
    if any(src in reachable_from(model, current) for src in e.sources):
        return TransitionStatus.LATER
    return TransitionStatus.NOT_ALLOWED


def written_values(model: type[Model], fields: Mapping[str, Any] | None) -> dict[str, Any]:
    """The columns a transition writes besides state and version: ``fields``, and
    ``updated_at`` when the model has one (a queryset UPDATE skips ``auto_now``).
    """
    values: dict[str, Any] = dict(fields or {})
    if _has_updated_at(model):
        values.setdefault("updated_at", timezone.now())
    return values


@cache
def _has_updated_at(model: type[Model]) -> bool:
    return any(f.name == "updated_at" for f in model._meta.concrete_fields)


def current_state(instance: Model) -> str:
    """The state of ``instance`` as read."""
    return str(state_field(type(instance)).get_state(instance))


def check_transition(instance: Model, name: str) -> TransitionResult:
    """Whether transition ``name`` can be applied to ``instance`` as read; no writes.

    ``APPLIED`` here means "may apply now": the state is a source and the
    transition's ``conditions=`` hold. A condition that does not hold is
    ``NOT_ALLOWED``.
    """
    model = type(instance)
    e = edge(model, name)
    current = current_state(instance)
    version: int = instance.version  # type: ignore[attr-defined]
    status = classify(model, name, current)
    if status is TransitionStatus.APPLIED:
        meta = getattr(model, name)._django_fsm
        if not meta.conditions_met(instance, current):
            status = TransitionStatus.NOT_ALLOWED
    return TransitionResult(status, current, e.target, version)


def unmet_conditions(instance: Model, name: str) -> list[str]:
    """Names of the ``conditions=`` of transition ``name`` that ``instance`` fails."""
    meta = getattr(type(instance), name)._django_fsm
    transition = meta.get_transition(current_state(instance))
    if transition is None:
        return []
    return [
        getattr(condition, "__name__", repr(condition))
        for condition in transition.conditions
        if not condition(instance)
    ]


def advance(
    instance: Model, name: str, values: Mapping[str, Any] | None = None
) -> TransitionResult:
    """Move ``instance`` along transition ``name`` in memory: state, ``version + 1``, ``values``.

    No database write and no check: the caller decided with
    :func:`check_transition` and commits the row with a conditional UPDATE
    (:func:`apply_transition` for one order; the batch consumer for many).
    """
    model = type(instance)
    field = state_field(model)
    e = edge(model, name)
    source = current_state(instance)
    field.set_state(instance, e.target)
    version = instance.version + 1  # type: ignore[attr-defined]
    instance.version = version  # type: ignore[attr-defined]
    for key, value in (values or {}).items():
        setattr(instance, key, value)
    return TransitionResult(TransitionStatus.APPLIED, source, e.target, version)


def transition_starting(instance: Model, name: str) -> None:
    """Send fsm-2's ``pre_transition`` for ``name`` from the state ``instance`` is in.

    Sent before the conditional UPDATE; a receiver that raises aborts the write.
    """
    if not pre_transition.has_listeners(type(instance)):
        return
    source = current_state(instance)
    pre_transition.send(**_fsm_signal(instance, name, source, edge(type(instance), name).target))


class FollowUp(Protocol):
    """Work a transition queues in its own transaction (an outbox row, for instance)."""

    def wanted(self, model: type[Model], target: str) -> bool:
        """Whether entering ``target`` on ``model`` queues this follow-up."""

    def write(self, instance: Model, name: str, result: TransitionResult) -> None:
        """Queue it, in the transaction that committed the transition."""


_follow_ups: list[FollowUp] = []


def register_follow_up(follow_up: FollowUp) -> None:
    """Run ``follow_up`` in the transaction of every transition it wants (idempotent)."""
    if follow_up not in _follow_ups:
        _follow_ups.append(follow_up)


def in_transaction_work(model: type[Model], target: str) -> bool:
    """Whether a transition into ``target`` has work to do inside its transaction:
    a follow-up, or a receiver of fsm-2's ``pre_transition``/``post_transition``.
    """
    return (
        any(f.wanted(model, target) for f in _follow_ups)
        or pre_transition.has_listeners(model)
        or post_transition.has_listeners(model)
    )


def transition_heard(model: type[Model], target: str) -> bool:
    """Whether announcing a transition into ``target`` reaches anyone: work inside
    its transaction (:func:`in_transaction_work`) or a receiver of
    :data:`~idempotent_orders.signals.order_transitioned`. The consuming paths
    skip :func:`transition_written` (and building what it is handed) otherwise.
    """
    return in_transaction_work(model, target) or order_transitioned.has_listeners(model)


def transition_written(instance: Model, name: str, result: TransitionResult) -> None:
    """Announce a transition whose UPDATE succeeded: fsm-2's ``post_transition`` and the
    follow-ups now, in the transaction (they may write in it), and
    :data:`~idempotent_orders.signals.order_transitioned` after commit.
    """
    model = type(instance)
    if post_transition.has_listeners(model):
        post_transition.send(**_fsm_signal(instance, name, result.source, result.target))
    for follow_up in _follow_ups:
        if follow_up.wanted(model, result.target):
            follow_up.write(instance, name, result)
    transaction.on_commit(
        lambda: order_transitioned.send(
            sender=model,
            order=instance,
            transition=name,
            source=result.source,
            target=result.target,
            version=result.version,
        ),
        using=instance._state.db,
    )


def _fsm_signal(instance: Model, name: str, source: str, target: str) -> dict[str, Any]:
    return {
        "sender": type(instance),
        "instance": instance,
        "name": name,
        "field": state_field(type(instance)),
        "source": source,
        "target": target,
        "method_args": (),
        "method_kwargs": {},
    }


def apply_transition(
    instance: Model,
    name: str,
    *,
    fields: Mapping[str, Any] | None = None,
    extra_filters: Mapping[str, Any] | None = None,
) -> TransitionResult:
    """Commit transition ``name`` with one conditional UPDATE; never raises on a lost race.

    ``UPDATE ... SET <state>=:target, version=version+1, <fields> WHERE id=:id AND
    <state> IN :sources AND version=:v``. On success the instance is updated to
    match the row; on any other result it is left as it was read, so it never
    holds a state the database does not. ``extra_filters`` add conditions to the
    WHERE clause (the consumer uses them for ``last_seq``). The transition's
    ``conditions=`` are checked on the instance as read; fsm-2's
    ``pre_transition`` is sent before the UPDATE and ``post_transition`` after
    it, both inside the caller's transaction.
    """
    checked = check_transition(instance, name)
    if not checked.applied:
        return checked
    model = type(instance)
    field = state_field(model)
    e = edge(model, name)
    values = written_values(model, fields)
    transition_starting(instance, name)
    rows = model._default_manager.filter(
        pk=instance.pk,
        **{f"{field.name}__in": sorted(e.sources)},
        version=checked.version,
        **dict(extra_filters or {}),
    ).update(**{field.name: e.target, "version": F("version") + 1}, **values)
    if rows != 1:
        return TransitionResult(
            TransitionStatus.CONFLICT, checked.source, e.target, checked.version
        )
    result = advance(instance, name, values)
    transition_written(instance, name, result)
    return result
