"""The batch's one conditional UPDATE of many orders, written as SQL on MariaDB and SQLite.

``UPDATE <order> SET <column> = CASE <pk> WHEN :pk THEN :value ... ELSE <column> END, ...
WHERE (<pk> = :pk AND version = :version) OR ...``: what the ORM's ``filter(...).update()``
with a ``Case`` of one ``When`` per order sends, without compiling that expression for
every message of the chunk (at 200 orders the compile cost more than the chunk's
statements together). Each value is prepared by its own field, as ``update()`` prepares a
value. PostgreSQL has its own statement (``UPDATE ... FROM unnest(<arrays>)``,
:mod:`~idempotent_orders.consuming.backends.postgresql.arrays`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.db import connections, router
from django.db.models import Field, Model
from django.db.models.manager import BaseManager

__all__ = ["update_many"]


def update_many(
    model: type[Model],
    changed: Mapping[Any, Mapping[str, Any]],
    read_version: Mapping[Any, int],
    names: Sequence[str],
) -> int | None:
    """Write ``changed`` (per order pk, the new value of each changed field) to the orders
    still at their ``read_version``; the number of rows it matched. None (nothing sent)
    where the ORM must write: a default manager with its own ``get_queryset``, a field
    of another table (multi-table inheritance), a value that is an expression.
    """
    if type(model._default_manager).get_queryset is not BaseManager.get_queryset:
        return None
    if any(
        hasattr(v, "resolve_expression") for values in changed.values() for v in values.values()
    ):
        return None  # an expression: the ORM compiles it
    meta = model._meta
    pk = meta.pk
    assert pk is not None
    fields: list[Field[Any, Any]] = []
    for name in names:
        field = meta.get_field(name)
        if not isinstance(field, Field) or field.model._meta.db_table != meta.db_table:
            return None
        fields.append(field)
    version = meta.get_field("version")
    assert isinstance(version, Field)
    if pk.model._meta.db_table != meta.db_table:
        return None
    conn = connections[router.db_for_write(model)]
    qn = conn.ops.quote_name
    pk_column = qn(str(pk.column))
    sets: list[str] = []
    params: list[Any] = []
    for field in fields:
        column = qn(str(field.column))
        arms = []
        for key, values in changed.items():
            if field.name in values:
                arms.append("WHEN %s THEN %s")
                params += [
                    pk.get_db_prep_value(key, conn),
                    field.get_db_prep_save(values[field.name], conn),
                ]
        sets.append(f"{column} = CASE {pk_column} {' '.join(arms)} ELSE {column} END")
    version_column = qn(str(version.column))
    where = " OR ".join([f"({pk_column} = %s AND {version_column} = %s)"] * len(changed))
    for key in changed:
        params += [pk.get_db_prep_value(key, conn), read_version[key]]
    sql = f"UPDATE {qn(meta.db_table)} SET {', '.join(sets)} WHERE {where}"
    with conn.cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount)
