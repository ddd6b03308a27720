"""SQL the consumers write by hand: the inbox claim, and claim-and-apply in one statement.

Both keep the inbox's unique index the only authority on duplicates.
:func:`insert_inbox_rows` is the batch path's multi-row ``INSERT ... ON
CONFLICT DO NOTHING RETURNING`` (``INSERT IGNORE ... RETURNING`` on MariaDB).
:func:`claim_and_apply` is the single path's PostgreSQL statement for a
message whose verdict is "apply": the inbox insert and the order's conditional
UPDATE in one statement, committed on its own (one round trip instead of
BEGIN, INSERT, UPDATE, COMMIT).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.db import DataError, connection
from django.db.models import Field, Model
from django.db.models.expressions import DatabaseDefault

from idempotent_orders.models import ProcessedMessage

__all__ = ["ClaimConflict", "can_claim_and_apply", "claim_and_apply", "insert_inbox_rows"]


class ClaimConflict(Exception):
    """The message was claimed but the order had moved: nothing was written; decide again."""


def _inbox_columns(row: ProcessedMessage) -> tuple[list[Field[Any, Any]], str]:
    """The columns an inbox INSERT writes (all but the key and database defaults)."""
    fields = [
        f
        for f in ProcessedMessage._meta.concrete_fields
        if not f.primary_key and not isinstance(getattr(row, f.attname), DatabaseDefault)
    ]
    qn = connection.ops.quote_name
    return fields, ", ".join(qn(str(f.column)) for f in fields)


def _inbox_values(fields: list[Field[Any, Any]], row: ProcessedMessage) -> list[Any]:
    return [f.get_db_prep_save(f.pre_save(row, True), connection) for f in fields]


def _names() -> tuple[str, str, str]:
    """Quoted table, primary key and message id column of the inbox."""
    meta = ProcessedMessage._meta
    qn = connection.ops.quote_name
    pk = qn(str(meta.pk.column if meta.pk else "id"))
    message_id = qn(str(meta.get_field("message_id").column))
    return qn(meta.db_table), pk, message_id


def _on_conflict() -> str:
    qn = connection.ops.quote_name
    unique = ", ".join(
        qn(str(ProcessedMessage._meta.get_field(name).column))  # type: ignore[union-attr]
        for name in ("consumer", "message_id")
    )
    return f"ON CONFLICT ({unique}) DO NOTHING"


def insert_inbox_rows(rows: Sequence[ProcessedMessage]) -> dict[str, int]:
    """Insert inbox rows, skipping ids already there; ``{message_id: pk}`` of the new ones."""
    fields, columns = _inbox_columns(rows[0])
    table, pk, message_id = _names()
    placeholder = "(" + ", ".join(["%s"] * len(fields)) + ")"
    params: list[Any] = []
    for row in rows:
        params.extend(_inbox_values(fields, row))
    returning = f"RETURNING {pk}, {message_id}"
    if connection.vendor == "mysql":
        # MariaDB >= 10.5 returns only the rows IGNORE let through. Nothing else
        # is ignored in practice: ids longer than the column never get here.
        head, tail = f"INSERT IGNORE INTO {table}", returning
    else:
        head, tail = f"INSERT INTO {table}", f"{_on_conflict()} {returning}"
    new: dict[str, int] = {}
    with connection.cursor() as cursor:
        if connection.features.can_return_rows_from_bulk_insert:
            values = ", ".join([placeholder] * len(rows))
            cursor.execute(f"{head} ({columns}) VALUES {values} {tail}", params)
            new.update((mid, pk_) for pk_, mid in cursor.fetchall())
        else:  # an old SQLite without RETURNING: one row at a time, same semantics
            width = len(fields)
            for n, row in enumerate(rows):
                cursor.execute(
                    f"{head} ({columns}) VALUES {placeholder} {tail}",
                    params[n * width : (n + 1) * width],
                )
                found = cursor.fetchall()
                if found:
                    new[row.message_id] = found[0][0]
    return new


def can_claim_and_apply() -> bool:
    """Whether :func:`claim_and_apply` may run now: PostgreSQL, outside any transaction.

    Inside a caller's transaction the single statement would not be the whole
    transaction (and its deliberate error would abort the caller's).
    """
    return connection.vendor == "postgresql" and not connection.in_atomic_block


#: SQLSTATE of the division by zero that undoes a claim whose UPDATE found no row.
_UNDO = "22012"


def claim_and_apply(
    row: ProcessedMessage,
    order: Model,
    *,
    state_column: str,
    sources: Sequence[str],
    target: str,
    version: int,
    values: Mapping[str, Any],
    conditions: Mapping[str, Any],
) -> bool:
    """Insert the inbox ``row`` and apply the transition in one statement; False for a duplicate.

    ``UPDATE <order> SET <state>=:target, version=version+1, <values> WHERE
    pk=:pk AND <state> IN :sources AND version=:v AND <conditions> AND the
    inbox insert happened``. When the insert happened but the UPDATE matched
    no row (another writer moved the order), the statement divides by zero on
    purpose, so PostgreSQL rolls all of it back: nothing is written and
    :class:`ClaimConflict` asks the caller to read the order and decide again.
    A duplicate inserts nothing and updates nothing.
    """
    qn = connection.ops.quote_name
    fields, columns = _inbox_columns(row)
    inbox, _, _ = _names()
    meta = order._meta
    table = qn(meta.db_table)
    pk_column = qn(str(meta.pk.column if meta.pk else "id"))
    sets = [f"{qn(state_column)} = %s", f"{qn('version')} = {qn('version')} + 1"]
    set_params: list[Any] = [target]
    for name, value in values.items():
        field = meta.get_field(name)
        assert isinstance(field, Field)
        sets.append(f"{qn(str(field.column))} = %s")
        set_params.append(field.get_db_prep_save(value, connection))
    where = [f"{pk_column} = %s", f"{qn(state_column)} = ANY(%s)", f"{qn('version')} = %s"]
    where_params: list[Any] = [order.pk, list(sources), version]
    for name, value in conditions.items():
        field = meta.get_field(name)
        assert isinstance(field, Field)
        where.append(f"{qn(str(field.column))} = %s")
        where_params.append(field.get_db_prep_save(value, connection))
    placeholder = ", ".join(["%s"] * len(fields))
    sql = (
        f"WITH claim AS (INSERT INTO {inbox} ({columns}) VALUES ({placeholder})"
        f" {_on_conflict()} RETURNING 1),"
        f" moved AS (UPDATE {table} SET {', '.join(sets)}"
        f" WHERE {' AND '.join(where)} AND EXISTS (SELECT 1 FROM claim) RETURNING 1)"
        " SELECT (SELECT count(*) FROM claim),"
        " CASE WHEN (SELECT count(*) FROM claim) = 1"
        " THEN 1 / (SELECT count(*) FROM moved) ELSE 0 END"
    )
    params = [*_inbox_values(fields, row), *set_params, *where_params]
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            claimed, _moved = cursor.fetchone()
    except DataError as exc:
        if getattr(exc.__cause__, "sqlstate", None) == _UNDO:
            raise ClaimConflict from None
        raise
    return bool(claimed)
