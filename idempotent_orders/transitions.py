"""The conditional transition: django-fsm-2's graph, committed by one optimistic-lock UPDATE.

The graph is read from the ``@transition`` declarations on the model; nothing
here, or anywhere else in the project, writes a second copy of it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from django.db import transaction
from django.db.models import F, Model
from django.utils import timezone
from django_fsm import ANY_OTHER_STATE, ANY_STATE, FSMFieldMixin

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


def _state_field(model: type[Model]) -> FSMFieldMixin:
    fields = [f for f in model._meta.concrete_fields if isinstance(f, FSMFieldMixin)]
    if len(fields) != 1:
        raise UnknownTransition(f"{model.__name__} must have exactly one FSM field")
    return fields[0]


@cache
def _graph(model: type[Model]) -> tuple[dict[str, Edge], dict[str, frozenset[str]]]:
    """Edges by method name, and the states reachable from each state, from the fsm meta."""
    field = _state_field(model)
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


def apply_transition(
    instance: Model,
    name: str,
    *,
    fields: Mapping[str, Any] | None = None,
    extra_filters: Mapping[str, Any] | None = None,
) -> TransitionResult:
    """Commit transition ``name`` with one conditional UPDATE; never raises on a lost race.

    ``UPDATE ... SET status=:target, version=version+1, <fields> WHERE id=:id AND
    status IN :sources AND version=:v``. On success the instance is updated to
    match the row; on any other result it is left as it was read, so it never
    holds a state the database does not. ``extra_filters`` add conditions to the
    WHERE clause (the consumer uses them for ``last_seq``).
    """
    model = type(instance)
    field = _state_field(model)
    e = edge(model, name)
    current = str(field.get_state(instance))
    version: int = instance.version  # type: ignore[attr-defined]
    status = classify(model, name, current)
    if status is not TransitionStatus.APPLIED:
        return TransitionResult(status, current, e.target, version)
    # Conditions declared on the transition still hold (checked on the instance as read).
    meta = getattr(model, name)._django_fsm
    if not meta.conditions_met(instance, current):
        return TransitionResult(TransitionStatus.NOT_ALLOWED, current, e.target, version)

    values: dict[str, Any] = dict(fields or {})
    now = timezone.now()
    if any(f.name == "updated_at" for f in model._meta.concrete_fields):
        values.setdefault("updated_at", now)
    rows = model._default_manager.filter(
        pk=instance.pk,
        **{f"{field.name}__in": sorted(e.sources)},
        version=version,
        **dict(extra_filters or {}),
    ).update(**{field.name: e.target, "version": F("version") + 1}, **values)
    if rows != 1:
        return TransitionResult(TransitionStatus.CONFLICT, current, e.target, version)
    field.set_state(instance, e.target)
    instance.version = version + 1  # type: ignore[attr-defined]
    for key, value in values.items():
        setattr(instance, key, value)
    transaction.on_commit(
        lambda: order_transitioned.send(
            sender=model,
            order=instance,
            transition=name,
            source=current,
            target=e.target,
            version=version + 1,
        ),
        using=instance._state.db,
    )
    return TransitionResult(TransitionStatus.APPLIED, current, e.target, version + 1)
