"""The single path's one-statement case on PostgreSQL: decide "apply" in SQL.

A new message normally costs two round trips: the order read, then the
claim-and-apply statement conditional on the version read. For the built-in
message types whose transition has one source and no ``conditions=``,
:func:`~idempotent_orders.engine.decide` says "apply" exactly when a few
column tests hold on the order (state, ``has_parked``, ``last_seq``, and the
validator's comparisons with the order, such as the amount and currency of a
payment). Those tests go into the claim-and-apply statement's WHERE clause
instead of a version read beforehand, so the message costs one statement,
committed on its own (prepared once per database session, see
:func:`~idempotent_orders.statements.fetch_one`):

``WITH claim AS (INSERT inbox ... ON CONFLICT DO NOTHING),
moved AS (UPDATE order SET ... WHERE pk AND <the tests> AND the claim happened
RETURNING the new row)``.

PostgreSQL checks the WHERE clause on the row version it locks (a concurrent
writer's committed change included), so the tests hold on the order the
update writes, as a read-then-conditional-update would ensure. Every test is
at least as strict as the Python validator (text compared bytewise, ``COLLATE
"C"``); anything else (the tests fail, a duplicate, a value the column cannot
take) writes nothing and the message takes the usual path: read, decide,
write. A project's own validator never takes this path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import DEFAULT_DB_ALIAS, DataError, connection, connections
from django.db.models import CharField, Field, Model, TextField
from django.utils import timezone

from idempotent_orders import handlers
from idempotent_orders.engine import Envelope
from idempotent_orders.exceptions import InvalidMessage
from idempotent_orders.models import Outcome
from idempotent_orders.statements import build, compiled_read, fetch_one, inbox_template
from idempotent_orders.transitions import (
    TransitionResult,
    TransitionStatus,
    edge,
    has_transition,
    in_transaction_work,
    state_field,
    transition_heard,
    transition_written,
    written_values,
)

__all__ = ["presume"]

#: ``(field name, value, empty_allowed)``: the column must equal ``value`` (or be empty).
Test = tuple[str, Any, bool]
#: Turns a payload into the written columns and the tests on the order; None: no guess.
Guard = Callable[[type[Model], Mapping[str, Any]], tuple[dict[str, Any], list[Test]] | None]


@functools.cache
def _names(model: type[Model]) -> frozenset[str]:
    return frozenset(f.name for f in model._meta.concrete_fields)


def _money(model: type[Model], payload: Mapping[str, Any]) -> list[Test] | None:
    """The amount/currency tests of ``handlers._check_money``; None when it would reject."""
    raw = payload.get("amount")
    if not isinstance(raw, str) or not raw.isascii():
        return None
    try:
        amount = Decimal(raw)
    except InvalidOperation:
        return None
    if not amount.is_finite() or amount <= 0:
        return None
    names = _names(model)
    tests: list[Test] = []
    if "amount" in names:
        tests.append(("amount", amount, False))
    if "currency" in names:
        currency = payload.get("currency")
        if not isinstance(currency, str):
            return None  # never equal to a column value: the validator rejects it
        tests.append(("currency", currency, False))
    return tests


def _text(payload: Mapping[str, Any], key: str, max_length: int) -> str | None:
    try:
        return handlers._text(payload, key, max_length=max_length)
    except InvalidMessage:
        return None


def _payment(model: type[Model], payload: Mapping[str, Any]) -> Any:
    payment_id = _text(payload, "payment_id", 128)
    tests = _money(model, payload)
    if payment_id is None or tests is None:
        return None
    if "payment_id" not in _names(model):
        return {}, tests
    return {"payment_id": payment_id}, [*tests, ("payment_id", payment_id, True)]


def _refund(model: type[Model], payload: Mapping[str, Any]) -> Any:
    payment_id = _text(payload, "payment_id", 128)
    tests = _money(model, payload)
    if payment_id is None or tests is None:
        return None
    if "payment_id" in _names(model):
        tests.append(("payment_id", payment_id, True))
    return {}, tests


def _shipment(model: type[Model], payload: Mapping[str, Any]) -> Any:
    tracking = _text(payload, "tracking_number", 128)
    carrier = _text(payload, "carrier", 64)
    if tracking is None or carrier is None:
        return None
    names = _names(model)
    values = {"tracking_number": tracking, "carrier": carrier}
    return {k: v for k, v in values.items() if k in names}, []


def _delivery(model: type[Model], payload: Mapping[str, Any]) -> Any:
    tracking = _text(payload, "tracking_number", 128)
    if tracking is None:
        return None
    if "tracking_number" not in _names(model):
        return {}, []
    return {}, [("tracking_number", tracking, True)]


def _nothing(model: type[Model], payload: Mapping[str, Any]) -> Any:
    return {}, []


#: The built-in validators and their SQL form. Keyed by the function itself, so a
#: type registered with a project's own validator never takes this path.
GUARDS: dict[Any, Guard] = {
    handlers.validate_payment: _payment,
    handlers.validate_refund: _refund,
    handlers.validate_shipment: _shipment,
    handlers.validate_delivery: _delivery,
    handlers._no_payload: _nothing,
}


@dataclass(frozen=True)
class _Shape:
    """What one (model, transition) allows: its single source and target."""

    source: str
    target: str


_shapes: dict[tuple[type[Model], str], _Shape | None] = {}


def _shape(model: type[Model], name: str) -> _Shape | None:
    key = (model, name)
    try:
        return _shapes[key]
    except KeyError:
        pass
    shape: _Shape | None = None
    if has_transition(model, name) and _is_text(state_field(model)):
        e = edge(model, name)
        if len(e.sources) == 1:
            (source,) = e.sources
            transition = getattr(model, name)._django_fsm.get_transition(source)
            if transition is not None and not transition.conditions:
                shape = _Shape(source, e.target)
    _shapes[key] = shape
    return shape


def _is_text(field: Any) -> bool:
    return isinstance(field, CharField | TextField)


def _sql(
    model: type[Model],
    insert: str,
    value_fields: list[Field[Any, Any]],
    tests: list[tuple[Field[Any, Any], bool]],
    seq: bool,
    attnames: tuple[str, ...],
) -> str:
    qn = connection.ops.quote_name
    meta = model._meta
    table = qn(meta.db_table)
    state = qn(str(state_field(model).column))
    pk = qn(str(meta.pk.column if meta.pk else "id"))
    version = qn(str(meta.get_field("version").column))  # type: ignore[union-attr]
    sets = [f"{state} = %s", f"{version} = {version} + 1"]
    sets += [f"{qn(str(f.column))} = %s" for f in value_fields]
    where = [f"{pk} = %s", f'{state} = %s COLLATE "C"']
    where.append(f"{qn(str(meta.get_field('has_parked').column))} = false")  # type: ignore[union-attr]
    if seq:
        where.append(f"{qn(str(meta.get_field('last_seq').column))} = %s")  # type: ignore[union-attr]
    for field, empty in tests:
        column = qn(str(field.column))
        collate = ' COLLATE "C"' if _is_text(field) else ""
        test = f"{column} = %s{collate}"
        where.append(f"({column} = '' OR {test})" if empty else test)
    by_attname = {f.attname: f for f in meta.concrete_fields}
    # Without anyone to hand the order to, the statement returns none of it.
    returning = ", ".join(qn(str(by_attname[a].column)) for a in attnames) or "1"
    return (
        f"WITH claim AS ({insert} RETURNING 1),"
        f" moved AS (UPDATE {table} SET {', '.join(sets)}"
        f" WHERE {' AND '.join(where)} AND EXISTS (SELECT 1 FROM claim)"
        f" RETURNING {returning})"
        " SELECT c.n, CASE WHEN c.n = 1 THEN 1 / (SELECT count(*) FROM moved) ELSE 0 END,"
        " moved.* FROM (SELECT count(*) AS n FROM claim) c LEFT JOIN moved ON true"
    )


_statements: dict[tuple[Any, ...], tuple[str, list[Field[Any, Any]], list[Field[Any, Any]]]] = {}


def presume(envelope: Envelope, consumer: str, model: type[Model]) -> Outcome | None:
    """Apply ``envelope`` in one statement when its verdict is "apply"; None: take the usual path.

    Call only where :func:`~idempotent_orders.statements.can_claim_and_apply` holds.
    On APPLIED the inbox row and the transition are committed and
    ``transition_written`` was called (when anyone listens for the order); the caller
    announces the outcome.
    """
    guard = GUARDS.get(envelope.handler.validate)
    if guard is None:
        return None
    name = envelope.handler.transition
    shape = _shape(model, name)
    if shape is None or in_transaction_work(model, shape.target):
        return None
    alias, plan = compiled_read(model, "pk")
    if plan is None or alias != DEFAULT_DB_ALIAS:
        return None
    # The wrapper itself, not the ``connection`` proxy: each attribute read
    # through the proxy costs a context-local lookup.
    conn = connections[alias]
    guessed = guard(model, envelope.payload)
    if guessed is None:
        return None
    fields, tests = guessed
    seq = envelope.seq
    values = written_values(model, {**fields, "last_seq": seq} if seq is not None else fields)
    meta = model._meta
    template = inbox_template()
    # The order as written is built only for someone to hand it to.
    announced = transition_heard(model, shape.target)
    key = (
        alias,
        model,
        tuple(values),
        tuple((t[0], t[2]) for t in tests),
        seq is None,
        announced,
    )
    statement = _statements.get(key)
    if statement is None:
        value_fields: list[Field[Any, Any]] = [meta.get_field(n) for n in values]  # type: ignore[misc]
        test_fields: list[Field[Any, Any]] = [meta.get_field(n) for n, _, _ in tests]  # type: ignore[misc]
        sql = _sql(
            model,
            template.sql,
            value_fields,
            [(f, t[2]) for f, t in zip(test_fields, tests, strict=True)],
            seq is not None,
            plan.attnames if announced else (),
        )
        statement = _statements[key] = (sql, value_fields, test_fields)
    sql, value_fields, test_fields = statement
    now = values.get("updated_at") or timezone.now()
    params = template.params(
        {
            "consumer": consumer,
            "message_id": envelope.message_id,
            "message_type": envelope.message_type,
            "order_id": envelope.order_id,
            "seq": seq,
        },
        now,
    )
    params.append(shape.target)
    params.extend(
        f.get_db_prep_save(v, conn) for f, v in zip(value_fields, values.values(), strict=True)
    )
    params.extend((envelope.order_id, shape.source))
    if seq is not None:
        params.append(seq - 1)
    params.extend(f.get_db_prep_save(t[1], conn) for f, t in zip(test_fields, tests, strict=True))
    try:
        row = fetch_one(sql, params, conn)
    except DataError:
        # The deliberate division by zero (the tests failed: nothing was written),
        # or a value a column cannot take: the usual path decides and says why.
        return None
    if row is None or not row[0]:
        return None  # a duplicate: the usual path reads the order and answers it
    if announced:
        order = build(model, alias, plan, row[2:])
        result = TransitionResult(
            TransitionStatus.APPLIED,
            shape.source,
            shape.target,
            order.version,  # type: ignore[attr-defined]
        )
        transition_written(order, name, result)
    return Outcome.APPLIED
