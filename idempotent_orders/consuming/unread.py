"""A message applied before its order is read: the plan every backend's road without a read
shares.

Where nothing of the project's runs and the transition has fixed sources and one target
(:func:`fits`), :func:`~idempotent_orders.consuming.decision.decide` says "apply" exactly
when a few column tests hold on the order: the state among the sources, ``has_parked``,
``last_seq`` and the rule's tests. A backend sends them in the WHERE clause of the
UPDATE (:func:`update_sql`) with the inbox claim
(:mod:`~idempotent_orders.consuming.backends.postgresql.one_statement` on PostgreSQL,
one source only; :mod:`~idempotent_orders.consuming.backends.at_once` on MariaDB and
SQLite). Anything else writes nothing and the message takes the read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS
from django.db.models import CharField, Field, Model, TextField

from idempotent_orders.consuming.backends import backend
from idempotent_orders.consuming.envelope import Envelope
from idempotent_orders.consuming.graph import (
    TransitionResult,
    TransitionStatus,
    edge,
    has_transition,
    state_field,
)
from idempotent_orders.consuming.payments import payment_id
from idempotent_orders.consuming.rules import Rule, Test
from idempotent_orders.consuming.running import (
    FollowUp,
    FollowUpRow,
    follow_up_rows,
    runs_user_code,
    transition_written,
)
from idempotent_orders.consuming.sql import build, compiled_read, handed_over

__all__ = ["Plan", "Shape", "field_of", "fits", "plan", "shape", "update_sql", "written"]


@dataclass(frozen=True)
class Shape:
    """What one (model, transition) allows: its sources (in a fixed order) and its target."""

    sources: tuple[str, ...]
    target: str


_shapes: dict[tuple[type[Model], str], Shape | None] = {}


def shape(model: type[Model], name: str) -> Shape | None:
    """The transition's sources and target; None where a source has a condition, the
    transition starts from any state or its body picks the target, or the state is not
    text (then the order is read)."""
    key = (model, name)
    try:
        return _shapes[key]
    except KeyError:
        pass
    found: Shape | None = None
    if has_transition(model, name) and isinstance(state_field(model), CharField | TextField):
        e = edge(model, name)
        declared = getattr(model, name)._django_fsm
        if (
            e.sources
            and e.target is not None
            and e.targets <= {e.target}
            and not (e.any_source or e.any_other or e.dynamic or e.targetless)
            and all(
                (t := declared.get_transition(source)) is not None and not t.conditions
                for source in e.sources
            )
        ):
            found = Shape(tuple(sorted(e.sources)), e.target)
    _shapes[key] = found
    return found


@dataclass(frozen=True)
class Plan:
    """What a message applied without a read writes and tests."""

    name: str
    shape: Shape
    #: The columns the rule writes from the payload.
    fields: dict[str, Any]
    #: The rule's column tests (see :data:`~idempotent_orders.consuming.rules.Test`).
    tests: list[Test]
    #: The payment id the message spends (None: not a money message).
    payment: str | None
    #: The order read's compiled plan (for building the order a road returns).
    read: Any
    #: The follow-ups the transition queues: ``[]`` none; one handed over as its outbox
    #: row; None: some write their own rows (in the road's transaction).
    follow_ups: list[tuple[FollowUp, FollowUpRow]] | None

    @property
    def handed(self) -> tuple[FollowUp, FollowUpRow] | None:
        """The one follow-up whose outbox row the road writes itself, if so."""
        rows = self.follow_ups
        return rows[0] if rows is not None and len(rows) == 1 else None


def fits(envelope: Envelope, model: type[Model], *, several: bool = False) -> bool:
    """Whether ``envelope``'s kind of message may go without a read, whatever its payload
    and its order: a built-in :class:`~idempotent_orders.consuming.rules.Rule` validates
    it, its transition has a :func:`shape` (of one source, unless the road tests
    ``several``), nothing of the project's runs. A message of another
    kind is read first (on PostgreSQL and MariaDB in the same text as its claim:
    :func:`~idempotent_orders.consuming.writing.apply`)."""
    if not isinstance(envelope.handler.validate, Rule):
        return False  # a project's own validator runs on the order as read
    name = envelope.handler.transition
    found = shape(model, name)
    # Else the model's own method must run: read, run, write.
    if found is None or (len(found.sources) > 1 and not several):
        return False
    return not runs_user_code(model, name)


def plan(envelope: Envelope, model: type[Model], *, several: bool = False) -> Plan | None:
    """How ``envelope`` is applied without a read (by a road that tests the state against
    ``several`` sources, or one); None when it must be read first."""
    if not fits(envelope, model, several=several):
        return None
    rule = envelope.handler.validate
    assert isinstance(rule, Rule)
    name = envelope.handler.transition
    found = shape(model, name)
    assert found is not None
    alias, read = compiled_read(model, "pk")
    if read is None or alias != DEFAULT_DB_ALIAS:
        return None
    tested = rule.tests(model, envelope.payload)
    if tested is None:
        return None  # the rule rejects it: the read says why
    rows = follow_up_rows(model, envelope.order_id, name, found.target)
    if rows is not None and (len(rows) > 1 or not all(handed_over(r[1].fields) for r in rows)):
        rows = None
    fields, tests = tested
    return Plan(name, found, fields, tests, payment_id(envelope), read, rows)


def field_of(model: type[Model], name: str) -> Field[Any, Any]:
    """The model's concrete field ``name`` (a column the roads without a read write or test)."""
    field = model._meta.get_field(name)
    assert isinstance(field, Field)
    return field


def update_sql(
    model: type[Model],
    place: Callable[[str, Field[Any, Any]], str],
    sources: int,
    values: Sequence[str],
    tests: Sequence[tuple[str, bool]],
    seq: bool,
    conn: Any,
) -> str:
    """The UPDATE of a road without a read: ``SET`` the target state, the version and
    ``values``; ``WHERE`` the "apply" of :func:`~idempotent_orders.consuming.decision.decide`
    as column tests: the primary key, the state among the ``sources``, no parked message,
    the previous ``seq``, the rule's ``tests`` (``(field name, empty allowed)``).

    ``place(role, field)`` writes each value's placeholder, in the order of the text:
    ``target``, ``value:<name>``, ``pk``, ``source:<n>``, ``previous_seq``, ``test:<name>``.
    """
    qn, bytewise = conn.ops.quote_name, backend(conn).bytewise
    meta = model._meta
    assert meta.pk is not None
    state_column = state_field(model)
    state = qn(str(state_column.column))
    version = qn(str(field_of(model, "version").column))
    sets = [f"{state} = {place('target', state_column)}", f"{version} = {version} + 1"]
    for name in values:
        field = field_of(model, name)
        sets.append(f"{qn(str(field.column))} = {place(f'value:{name}', field)}")
    states = [bytewise(state, place(f"source:{n}", state_column)) for n in range(sources)]
    where = [
        f"{qn(str(meta.pk.column))} = {place('pk', meta.pk)}",
        states[0] if sources == 1 else f"({' OR '.join(states)})",
        f"{qn(str(field_of(model, 'has_parked').column))} = FALSE",
    ]
    if seq:
        last_seq = field_of(model, "last_seq")
        where.append(f"{qn(str(last_seq.column))} = {place('previous_seq', last_seq)}")
    for name, empty in tests:
        field = field_of(model, name)
        column = qn(str(field.column))
        value = place(f"test:{name}", field)
        text = isinstance(field, CharField | TextField)
        test = bytewise(column, value) if text else f"{column} = {value}"
        where.append(f"({column} = '' OR {test})" if empty else test)
    return f"UPDATE {qn(meta.db_table)} SET {', '.join(sets)} WHERE {' AND '.join(where)}"


def written(model: type[Model], p: Plan, row: Sequence[Any], source: str | None = None) -> None:
    """Tell the project's listeners that ``p`` was applied: ``row`` is the order as written
    (the read's columns); ``source`` the state it left, where the shape has several."""
    order = build(model, DEFAULT_DB_ALIAS, p.read, row)
    if source is None:
        (source,) = p.shape.sources
    result = TransitionResult(
        TransitionStatus.APPLIED,
        source,
        p.shape.target,
        order.version,  # type: ignore[attr-defined]
    )
    handed = p.handed
    transition_written(order, p.name, result, handed=() if handed is None else (handed[0],))
