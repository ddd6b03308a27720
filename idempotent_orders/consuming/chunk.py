"""A batch chunk's rows and statements: the message item, the claim of the chunk's inbox
rows, the lock of its orders, and the one conditional UPDATE of every order it changed
(:mod:`~idempotent_orders.consuming.batch` decides between them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.db import connection
from django.db.models import (
    BooleanField,
    Case,
    CharField,
    F,
    Field,
    IntegerField,
    Model,
    Q,
    TextField,
    Value,
    When,
)
from django.db.models.expressions import RawSQL
from django.utils import timezone

from idempotent_orders import get_order_model
from idempotent_orders.consuming.decision import unknown_order
from idempotent_orders.consuming.envelope import BODY_EXCERPT, Envelope, serialise
from idempotent_orders.consuming.sql import (
    CLAIMABLE,
    _on_conflict,
    inbox_partitioned,
    inbox_template,
    insert_inbox_values,
)
from idempotent_orders.consuming.sql import _names as _inbox_names
from idempotent_orders.exceptions import ConcurrentUpdate
from idempotent_orders.models import (
    AbstractOrder,
    InboxStatus,
    Outcome,
    ProcessedMessage,
)

__all__ = ["Item", "claim", "claim_postgres", "lock_orders", "update_orders"]


@dataclass
class Item:
    index: int
    envelope: Envelope
    pk: int = 0
    #: The outcome this delivery reports (what the single path returns for it).
    outcome: Outcome = Outcome.APPLIED
    reason: str = ""
    #: The outcome its inbox row ends with, when it differs: a message parked
    #: and released within the batch reports ``parked`` and records the release.
    recorded_outcome: Outcome | None = None
    #: The inbox row as inserted is final (an applied message, or an unknown order).
    recorded: bool = True
    #: The order exists: its parked successors are worth a look after commit.
    order_exists: bool = True


def claim(consumer: str, items: list[Item], known: set[int]) -> dict[str, int]:
    """Insert an inbox row per message; return ``{message_id: pk}`` of the rows that are new.

    Rows go in sorted by message id, so concurrent batches take the unique
    index's locks in one order and cannot deadlock on each other.
    """
    now = timezone.now()
    template = inbox_template()
    rows = []
    for item in sorted(items, key=lambda i: i.envelope.message_id):
        env = item.envelope
        if env.order_id in known:
            status, outcome, error, body = InboxStatus.DONE, Outcome.APPLIED, "", ""
            order_id: int | None = env.order_id
        else:  # decided now: nothing else can change an unknown order's verdict
            item.outcome, item.reason = Outcome.REJECTED, unknown_order(env).reason
            item.order_exists = False
            status, outcome, error = InboxStatus.REJECTED, Outcome.REJECTED, item.reason
            body = serialise(env.as_dict())[:BODY_EXCERPT]
            order_id = None
        rows.append(
            template.params(
                {
                    "consumer": consumer,
                    "message_id": env.message_id,
                    "message_type": env.message_type,
                    "status": str(status),
                    "outcome": str(outcome),
                    "order_id": order_id,
                    "seq": env.seq,
                    "error": error,
                    "body": body,
                    "fingerprint": env.fingerprint,
                },
                now,
            )
        )
    return insert_inbox_values(template.fields, rows)


def claim_postgres(consumer: str, items: list[Item]) -> dict[str, int]:
    """:func:`_claim` on PostgreSQL in one statement that also looks the orders up.

    ``INSERT ... SELECT ... FROM unnest(<ids>, <types>, <orders>, <seqs>) ... ON
    CONFLICT DO NOTHING RETURNING id, message_id, order_id``: the columns that
    are the same for every row are one parameter each, the per-message ones one
    array each, and ``order_id`` is the order's own id or NULL when there is no
    such order (``unknown order``: marked here, recorded by :func:`_record_outcomes`).
    Rows go in sorted by message id, as in :func:`_claim`.
    """
    template = inbox_template()
    fields = template.fields
    qn = connection.ops.quote_name
    ordered = sorted(items, key=lambda i: i.envelope.message_id)
    first = ordered[0].envelope
    row = template.params(
        {
            "consumer": consumer,
            "message_id": first.message_id,
            "message_type": first.message_type,
            "status": str(InboxStatus.DONE),
            "outcome": str(Outcome.APPLIED),
            "order_id": first.order_id,
            "seq": first.seq,
            "error": "",
            "body": "",
            "fingerprint": first.fingerprint,
        },
        timezone.now(),
    )
    per_row: dict[str, list[Any]] = {
        "fingerprint": [i.envelope.fingerprint for i in ordered],
        "message_id": [i.envelope.message_id for i in ordered],
        "message_type": [i.envelope.message_type for i in ordered],
        "order_id": [i.envelope.order_id for i in ordered],
        "seq": [i.envelope.seq for i in ordered],
    }
    model = get_order_model()
    order_table = qn(model._meta.db_table)
    order_pk = qn(str(model._meta.pk.column if model._meta.pk else "id"))
    selected: list[str] = []
    arrays: list[str] = []
    aliases: list[str] = []
    params: list[Any] = []
    array_params: list[Any] = []
    for pos, f in enumerate(fields):
        name = f.attname
        if name not in per_row:
            selected.append(f"%s::{f.db_type(connection)}")
            params.append(row[pos])
            continue
        arrays.append(f"%s::{f.db_type(connection)}[]")
        array_params.append(_array(per_row[name]))
        aliases.append(qn(name))
        if name == "order_id":
            selected.append(
                f"(SELECT o.{order_pk} FROM {order_table} AS o WHERE o.{order_pk} = v.{qn(name)})"
            )
        else:
            selected.append(f"v.{qn(name)}")
    table, pk, message_id = _inbox_names()
    order_column = qn(str(ProcessedMessage._meta.get_field("order").column))
    claimable = ""
    if inbox_partitioned():
        claimable = f" WHERE {CLAIMABLE}(%s, v.{qn('message_id')})"
        array_params.append(consumer)
    sql = (
        f"INSERT INTO {table} ({', '.join(qn(str(f.column)) for f in fields)})"
        f" SELECT {', '.join(selected)} FROM unnest({', '.join(arrays)}) AS v({', '.join(aliases)})"
        f"{claimable} {_on_conflict()} RETURNING {pk}, {message_id}, {order_column}"
    )
    by_id = {i.envelope.message_id: i for i in items}
    new: dict[str, int] = {}
    with connection.cursor() as cursor:
        cursor.execute(sql, params + array_params)
        for pk_, mid, order_id in cursor.fetchall():
            new[mid] = pk_
            if order_id is None:  # no such order: rejected, as _claim records it
                item = by_id[mid]
                item.outcome, item.reason = Outcome.REJECTED, unknown_order(item.envelope).reason
                item.order_exists, item.recorded = False, False
    return new


def _array(values: list[Any]) -> Any:
    """``values`` as one PostgreSQL array literal (text), or the list itself.

    psycopg adapts a list element by element in Python; for the types written
    here (text, integers, aware datetimes, finite decimals, NULL) the literal is
    built in one pass. Any other type is left to psycopg.
    """
    parts: list[str] = []
    append = parts.append
    for value in values:
        kind = type(value)
        if value is None:
            append("NULL")
        elif kind is int:
            append(str(value))
        elif kind is str:
            append('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"')
        elif kind is datetime and value.tzinfo is not None:
            append('"' + value.isoformat() + '"')
        elif kind is Decimal and value.is_finite():
            append(str(value))
        else:
            return values
    return "{" + ",".join(parts) + "}"


def lock_orders(order_ids: set[int]) -> dict[int, AbstractOrder]:
    """The orders, locked in primary key order so that concurrent batches queue, never deadlock."""
    if not order_ids:
        return {}
    model = get_order_model()
    locked = model._default_manager.select_for_update()
    if connection.vendor == "postgresql":
        # ``pk = ANY(<one array>)``: ``pk__in`` prepares a parameter per order.
        qn = connection.ops.quote_name
        pk = model._meta.pk
        assert pk is not None
        column = f"{qn(model._meta.db_table)}.{qn(str(pk.column))}"
        any_of = RawSQL(
            f"{column} = ANY(%s::{pk.rel_db_type(connection)}[])",
            (_array(sorted(order_ids)),),
            output_field=BooleanField(),
        )
        locked = locked.filter(any_of)
    else:
        locked = locked.filter(pk__in=order_ids)
    return {o.pk: o for o in locked.order_by("pk")}


def update_orders(changed: Mapping[int, dict[str, Any]], read_version: Mapping[int, int]) -> None:
    """One conditional UPDATE of every changed order: ``WHERE (id=:id AND version=:v) OR ...``."""
    model = get_order_model()
    names = sorted({name for values in changed.values() for name in values})
    if connection.vendor == "postgresql":
        _update_orders_from_values(model, changed, read_version, names)
        return
    assignments: dict[str, Any] = {
        name: Case(
            *(
                When(pk=pk, then=Value(values[name]))
                for pk, values in changed.items()
                if name in values
            ),
            default=F(name),
            output_field=_concrete(model, name),
        )
        for name in names
    }
    condition = Q()
    for pk in changed:
        condition |= Q(pk=pk, version=read_version[pk])
    rows = model._default_manager.filter(condition).update(**assignments)
    if rows != len(changed):
        # The rows are locked, so this means a writer ignored the lock (or a
        # database without row locks let one through): start the batch again.
        raise ConcurrentUpdate(f"{len(changed) - rows} of {len(changed)} orders changed under us")


def _update_orders_from_values(
    model: type[Model],
    changed: Mapping[int, dict[str, Any]],
    read_version: Mapping[int, int],
    names: list[str],
) -> None:
    """PostgreSQL: the same conditional UPDATE as ``UPDATE ... FROM unnest(<arrays>)``.

    NULL in a row means "unchanged", so a transition cannot write NULL on this
    path (the single path can); the built-in columns are never nullable.

    Building a CASE per column per order costs more in Python than the
    statement costs the database; arrays cost next to nothing.
    """
    qn = connection.ops.quote_name
    fields = [_concrete(model, name) for name in names]
    columns = [str(f.column) for f in fields]
    # One array per column (unnest): the statement text does not grow with the
    # number of orders, so the driver does not parse a placeholder per value.
    plains = [_plain_type(f) for f in fields]
    prepared: dict[tuple[int, int], Any] = {}
    ids: list[int] = []
    versions: list[int] = []
    arrays: list[list[Any]] = [[] for _ in fields]
    for pk, values in changed.items():
        ids.append(pk)
        versions.append(read_version[pk])
        for n, (array, f, plain) in enumerate(zip(arrays, fields, plains, strict=True)):
            value = values.get(f.name)
            if value is not None and type(value) is not plain:
                key = (n, id(value))  # the chunk's one updated_at is prepared once
                if key not in prepared:
                    prepared[key] = f.get_db_prep_save(value, connection)
                value = prepared[key]
            array.append(value)
    params: list[Any] = [_array(ids), _array(versions), *map(_array, arrays)]
    table = qn(model._meta.db_table)
    pk_column = qn(str(model._meta.pk.column if model._meta.pk else "id"))
    sets = ", ".join(f"{qn(c)} = COALESCE(v.{qn('new_' + c)}, o.{qn(c)})" for c in columns)
    aliases = ", ".join(qn("new_" + c) for c in columns)
    unnest = ", ".join(
        ["%s::bigint[]", "%s::bigint[]"] + [f"%s::{f.db_type(connection)}[]" for f in fields]
    )
    sql = (
        f"UPDATE {table} AS o SET {sets}"
        f" FROM unnest({unnest}) AS v(id, read_version, {aliases})"
        f" WHERE o.{pk_column} = v.id AND o.{qn('version')} = v.read_version"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.rowcount
    if rows != len(changed):
        raise ConcurrentUpdate(f"{len(changed) - rows} of {len(changed)} orders changed under us")


def _plain_type(field: Field[Any, Any]) -> type | None:
    """The value type that ``field`` prepares for the database as it is.

    ``str`` for a field that prepares text as Django's ``CharField``/``TextField``
    do (fsm-2's state field included), ``int`` for one that prepares integers as
    ``IntegerField`` does; None for any other field (every value is prepared).
    """
    field_class: Any = type(field)
    if field_class.get_db_prep_save is not Field.get_db_prep_save:
        return None
    prep = (field_class.get_prep_value, field_class.to_python)
    if field_class.get_db_prep_value is Field.get_db_prep_value and prep in (
        (CharField.get_prep_value, CharField.to_python),
        (TextField.get_prep_value, TextField.to_python),
    ):
        return str
    if field_class.get_db_prep_value is IntegerField.get_db_prep_value and prep == (
        IntegerField.get_prep_value,
        IntegerField.to_python,
    ):
        return int
    return None


def _concrete(model: type[Model], name: str) -> Field[Any, Any]:
    found = model._meta.get_field(name)
    assert isinstance(found, Field)
    return found
