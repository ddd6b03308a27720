"""django-fsm-2's graph of an order model, read from its ``@transition`` declarations.

Nothing here, or anywhere else in the project, writes a second copy of it: the
edges, the states reachable from each state, and where a state stands relative
to a transition (may apply, at its target, past it, later, never) are all read
from the model's own fsm-2 metadata, with the state field's own Python types.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

from django.db.models import Model

from idempotent_orders.exceptions import UnknownTransition
from idempotent_orders.fsm import ANY_OTHER_STATE, ANY_STATE, FSMFieldMixin, State


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
    #: The body raised and fsm-2's ``on_error`` moved the order (committed).
    FAILED = "failed"


@dataclass(frozen=True)
class TransitionResult:
    status: TransitionStatus
    source: Any
    target: Any
    version: int

    @property
    def applied(self) -> bool:
        return self.status is TransitionStatus.APPLIED


@dataclass(frozen=True)
class Edge:
    """One declared transition: ``name`` moves ``sources`` to ``target``.

    States keep the Python type of the state field's values (``str`` for
    ``FSMField``, ``int`` for ``FSMIntegerField``, the key for ``FSMKeyField``).
    ``source="*"`` and ``source="+"`` (``ANY_STATE``, ``ANY_OTHER_STATE``) are
    kept as ``any_source`` / ``any_other`` besides the known states they
    expand to. ``target`` is the one concrete target, or ``None`` for a
    transition without one (targetless: the state stays; ``RETURN_VALUE`` /
    ``GET_STATE``: the body decides); ``targets`` lists every state it may end in.
    """

    name: str
    sources: frozenset[Any]
    target: Any
    targets: frozenset[Any] = frozenset()
    any_source: bool = False
    any_other: bool = False
    #: The body picks the target (``RETURN_VALUE``/``GET_STATE``) or there is none.
    dynamic: bool = False
    targetless: bool = False

    def allows(self, state: Any) -> bool:
        """Whether the transition may start from ``state`` (fsm-2's ``has_transition``)."""
        if state in self.sources or self.any_source:
            return True
        return self.any_other and state != self.target


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


def _possible_targets(transition: Any, source: Any) -> tuple[set[Any], bool, bool]:
    """The states one declared ``(source, target)`` may end in; (targets, dynamic, targetless)."""
    target = transition.target
    if target is None:
        return ({source} if source not in (ANY_STATE, ANY_OTHER_STATE) else set()), False, True
    if isinstance(target, State):
        return set(target.allowed_states or ()), True, False
    return {target}, False, False


@cache
def _graph(model: type[Model]) -> tuple[dict[str, Edge], dict[Any, frozenset[Any]]]:
    """Edges by method name, and the states reachable from each state, from the fsm meta."""
    field = state_field(model)
    known: set[Any] = {value for value, _ in field.flatchoices if value not in ("", None)}
    for method in field.transitions[model].values():
        for source, declared in method._django_fsm.transitions.items():
            if source not in (ANY_STATE, ANY_OTHER_STATE):
                known.add(source)
            possible, _, _ = _possible_targets(declared, source)
            known |= possible
    edges: dict[str, Edge] = {}
    for name, method in field.transitions[model].items():
        meta = method._django_fsm
        sources: set[Any] = set()
        targets: set[Any] = set()
        dynamic = targetless = any_source = any_other = False
        concrete: set[Any] = set()
        for source, declared in meta.transitions.items():
            possible, is_dynamic, is_targetless = _possible_targets(declared, source)
            dynamic |= is_dynamic
            targetless |= is_targetless
            if not is_dynamic and not is_targetless:
                concrete.add(declared.target)
            targets |= possible
            if source == ANY_STATE:
                any_source = True
                sources |= known
            elif source == ANY_OTHER_STATE:
                any_other = True
                sources |= known - {declared.target}
            else:
                sources.add(source)
        if targetless:
            targets |= sources
        single = (
            next(iter(concrete)) if len(concrete) == 1 and not (dynamic or targetless) else None
        )
        edges[name] = Edge(
            name=name,
            sources=frozenset(sources),
            target=single,
            targets=frozenset(targets),
            any_source=any_source,
            any_other=any_other,
            dynamic=dynamic,
            targetless=targetless,
        )

    successors: dict[Any, set[Any]] = {state: set() for state in known}
    for e in edges.values():
        for source in e.sources:
            successors.setdefault(source, set()).update({source} if e.targetless else e.targets)
    reachable: dict[Any, frozenset[Any]] = {}
    for state in successors:
        seen: set[Any] = set()
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


def reachable_from(model: type[Model], state: Any) -> frozenset[Any]:
    """States that some sequence of declared transitions leads to from ``state``."""
    return _graph(model)[1].get(state, frozenset())


def classify(model: type[Model], name: str, current: Any) -> TransitionStatus:
    """Where ``current`` stands relative to transition ``name``, without touching the database.

    ``APPLIED`` when fsm-2 itself would let the transition start from ``current``
    (its ``has_transition``: the listed sources, ``"*"``, ``"+"``), conditions aside;
    ``LATER`` whenever some path leads from ``current`` back to a state it may start
    from, even past its target (a cyclic graph); ``PAST_TARGET`` only when none does.
    """
    e = edge(model, name)
    if e.allows(current):
        return TransitionStatus.APPLIED
    if not e.targetless and not e.dynamic and current in e.targets:
        # (Where the body picks the target, being at one of them proves nothing.)
        return TransitionStatus.AT_TARGET
    # "May still apply" is decided before "moved past": in a graph with cycles (``'*'``
    # and ``'+'`` sources, a way back) an order past the target may come round again.
    if may_apply_later(model, name, current):
        return TransitionStatus.LATER
    if any(current in reachable_from(model, t) for t in e.targets):
        return TransitionStatus.PAST_TARGET
    return TransitionStatus.NOT_ALLOWED


def may_apply_later(model: type[Model], name: str, state: Any) -> bool:
    """Whether transition ``name`` may start again after the order leaves ``state``
    (some path of declared transitions leads from ``state`` back to one of its sources).
    """
    e = edge(model, name)
    return any(e.allows(s) for s in reachable_from(model, state))


def current_state(instance: Model) -> Any:
    """The state of ``instance`` as read, with the state field's own Python type."""
    return state_field(type(instance)).get_state(instance)


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
