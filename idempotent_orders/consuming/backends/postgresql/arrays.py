"""PostgreSQL's batch statements: one array per column (``unnest(%s::<type>[])``, ``= ANY``),
so a statement's text does not grow with its rows and the driver parses no placeholder
per value."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any, cast

from django.db import connection, transaction
from django.db.models import BooleanField, Field, Model
from django.db.models.expressions import RawSQL

from idempotent_orders import get_order_model
from idempotent_orders.consuming.payments import SPENT_FIELDS, spent_table
from idempotent_orders.consuming.sql import (
    CLAIMABLE,
    inbox_names,
    inbox_partitioned,
    inbox_template,
    on_conflict,
    plain_type,
)
from idempotent_orders.models import ProcessedMessage, SpentPayment

__all__ = ["any_of", "array_literal", "claim", "record_spent", "update_orders"]


def array_literal(values: list[Any]) -> Any:
    """``values`` as one PostgreSQL array literal (text), or the list itself.

    psycopg adapts a list element by element in Python; for the types written
    here (text, integers, aware datetimes, finite decimals, NULL) the literal is
    built in one pass. Any other type is left to psycopg.
    """
    kinds = set(map(type, values))
    if kinds == {str}:
        text = '","'.join(values)
        if "\\" not in text and text.count('"') == 2 * (len(values) - 1):
            return '{"' + text + '"}'  # nothing to escape: the usual case, built in C
    elif kinds == {int}:
        return "{" + ",".join(map(str, values)) + "}"
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


def claim(
    consumer: str, envelopes: Sequence[Any], row: Sequence[Any]
) -> list[tuple[int, str, Any]]:
    """The batch's inbox claim in one statement that also looks the orders up: the rows
    inserted, as ``(pk, message id, order id or None)``.

    ``INSERT ... SELECT ... FROM unnest(<ids>, <types>, <orders>, <seqs>) ... ON
    CONFLICT DO NOTHING RETURNING id, message_id, order_id``: the columns that
    are the same for every row are one parameter each, the per-message ones one
    array each, and ``order_id`` is the order's own id or NULL when there is no
    such order. ``envelopes`` in the order their rows go in; ``row``: the prepared
    values of an applied message's row (``InboxTemplate.params``), which give the
    columns that are the same for every row.
    """
    fields = inbox_template().fields
    qn = connection.ops.quote_name
    per_row: dict[str, list[Any]] = {
        "fingerprint": [e.fingerprint for e in envelopes],
        "message_id": [e.message_id for e in envelopes],
        "message_type": [e.message_type for e in envelopes],
        "order_id": [e.order_id for e in envelopes],
        "seq": [e.seq for e in envelopes],
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
        array_params.append(array_literal(per_row[name]))
        aliases.append(qn(name))
        if name == "order_id":
            selected.append(
                f"(SELECT o.{order_pk} FROM {order_table} AS o WHERE o.{order_pk} = v.{qn(name)})"
            )
        else:
            selected.append(f"v.{qn(name)}")
    table, pk, message_id = inbox_names()
    order_column = qn(str(ProcessedMessage._meta.get_field("order").column))
    claimable = ""
    if inbox_partitioned():
        claimable = f" WHERE {CLAIMABLE}(%s, v.{qn('message_id')})"
        array_params.append(consumer)
    sql = (
        f"INSERT INTO {table} ({', '.join(qn(str(f.column)) for f in fields)})"
        f" SELECT {', '.join(selected)} FROM unnest({', '.join(arrays)}) AS v({', '.join(aliases)})"
        f"{claimable} {on_conflict()} RETURNING {pk}, {message_id}, {order_column}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params + array_params)
        return list(cursor.fetchall())


def any_of(model: type[Model], ids: set[int]) -> RawSQL:
    """``<pk> = ANY(<one array>)``: the filter of a batch's orders (``pk__in`` prepares a
    parameter per order)."""
    pk = model._meta.pk
    assert pk is not None
    qn = connection.ops.quote_name
    column = f"{qn(model._meta.db_table)}.{qn(str(pk.column))}"
    return RawSQL(
        f"{column} = ANY(%s::{pk.rel_db_type(connection)}[])",
        (array_literal(sorted(ids)),),
        output_field=BooleanField(),
    )


def update_orders(
    model: type[Model],
    changed: Mapping[int, Mapping[str, Any]],
    read_version: Mapping[int, int],
    names: Sequence[str],
) -> int:
    """A batch chunk's one conditional UPDATE of every order it changed, as ``UPDATE ...
    FROM unnest(<arrays>)``; the number of rows it wrote.

    NULL in a row means "unchanged", except in a column that some order of the
    chunk sets to NULL: a boolean array then says which rows write it.

    Building a CASE per column per order costs more in Python than the
    statement costs the database; arrays cost next to nothing.
    """
    conn = transaction.get_connection()  # not the proxy: it is used once per value
    qn = conn.ops.quote_name
    fields = [cast(Field[Any, Any], model._meta.get_field(name)) for name in names]
    columns = [str(f.column) for f in fields]
    # One array per column (unnest): the statement text does not grow with the
    # number of orders, so the driver does not parse a placeholder per value.
    rows = list(changed.values())
    ids = list(changed)
    params: list[Any] = [array_literal(ids), array_literal([read_version[pk] for pk in ids])]
    # A column some order sets to NULL (a transition body may) carries one more
    # array, which says per row whether the column is written.
    nulled: list[str] = []
    for f in fields:
        name = f.name
        array = [values.get(name) for values in rows]
        plain = plain_type(f)
        prepared: dict[int, Any] = {}  # the chunk's one updated_at is prepared once
        for n, value in enumerate(array):
            if value is None:
                if name in rows[n] and name not in nulled:
                    nulled.append(name)
            elif type(value) is not plain:
                key = id(value)
                if key not in prepared:
                    prepared[key] = f.get_db_prep_save(value, conn)
                array[n] = prepared[key]
        params.append(array_literal(array))
    params += [
        array_literal(["t" if name in values else "f" for values in rows]) for name in nulled
    ]
    table = qn(model._meta.db_table)
    pk_column = qn(str(model._meta.pk.column if model._meta.pk else "id"))
    sets = ", ".join(
        f"{qn(c)} = CASE WHEN v.{qn('set_' + c)} THEN v.{qn('new_' + c)} ELSE o.{qn(c)} END"
        if f.name in nulled
        else f"{qn(c)} = COALESCE(v.{qn('new_' + c)}, o.{qn(c)})"
        for f, c in zip(fields, columns, strict=True)
    )
    masks = [str(f.column) for f in fields if f.name in nulled]
    aliases = ", ".join([qn("new_" + c) for c in columns] + [qn("set_" + c) for c in masks])
    unnest = ", ".join(
        ["%s::bigint[]", "%s::bigint[]"]
        + [f"%s::{f.db_type(conn)}[]" for f in fields]
        + ["%s::boolean[]"] * len(masks)
    )
    sql = (
        f"UPDATE {table} AS o SET {sets}"
        f" FROM unnest({unnest}) AS v(id, read_version, {aliases})"
        f" WHERE o.{pk_column} = v.id AND o.{qn('version')} = v.read_version"
    )
    with conn.cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount)


def record_spent(consumer: str, rows: Sequence[tuple[str, Any, str]], skip_spent: bool) -> set[str]:
    """Many spent payments as one ``INSERT ... SELECT FROM unnest(<arrays>)`` (no model
    instance per row, one text for any number of rows); the ids inserted."""
    table, columns = spent_table()
    meta = SpentPayment._meta
    types = [meta.get_field(name).db_type(connection) for name in SPENT_FIELDS[:2]]
    sql = (
        f"INSERT INTO {table} ({', '.join(columns)})"
        f" SELECT v.p, v.o, %s, v.m FROM unnest(%s::{types[0]}[], %s::{types[1]}[],"
        f" %s::{meta.get_field('message_id').db_type(connection)}[]) AS v(p, o, m)"
    )
    if skip_spent:
        sql += f" ON CONFLICT ({columns[0]}) DO NOTHING RETURNING {columns[0]}"
    payments, orders, messages = ([row[n] for row in rows] for n in range(3))
    params = [consumer, array_literal(payments), array_literal(orders), array_literal(messages)]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {p for (p,) in cursor.fetchall()} if skip_spent else set(payments)
