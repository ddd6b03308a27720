"""PostgreSQL: one statement for a message with nothing of the project's to run, two texts
for one that runs the project's code (its claim and spent payment in one statement, with
data-modifying ``WITH`` clauses), arrays for a batch's columns; how a text of several
statements is sent (:func:`send_text`, :func:`send_first`)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from django.db import DatabaseError, OperationalError, connection
from django.db.backends.utils import CursorWrapper

from idempotent_orders.consuming.backends import Backend, Block
from idempotent_orders.consuming.backends.postgresql.arrays import (
    any_of,
    record_spent,
    update_orders,
)
from idempotent_orders.consuming.payments import spent_by, spent_table
from idempotent_orders.consuming.sql import inbox_partitioned, inbox_template
from idempotent_orders.prepared import execute_text
from idempotent_orders.vendors import postgresql

__all__ = [
    "PostgreSQL",
    "Statement",
    "claim_and_spend_sql",
    "named",
    "send_first",
    "send_text",
    "spent_after",
]


class PostgreSQL(postgresql.PostgreSQL, Backend):
    without_read = ("backends.postgresql.one_statement:apply_unread",)
    unread_in_savepoint = True
    two_texts = "backends.postgresql.texts:PostgreSQLTexts"

    # A batch's statements take one array per column.
    pk_in = staticmethod(any_of)
    update_orders = staticmethod(update_orders)
    record_spent = staticmethod(record_spent)

    def claim_and_spend(
        self, values: Mapping[str, Any], now: Any, payment: str, order_id: Any
    ) -> tuple[bool, Any | None]:
        template = inbox_template()
        key = (connection.alias, inbox_partitioned())
        sql = _claims.get(key)
        if sql is None:
            sql = _claims[key] = claim_and_spend_sql(template.sql)
        params = template.params(values, now)
        consumer, message_id = values["consumer"], values["message_id"]
        with connection.cursor() as cursor:
            cursor.execute(sql, [*params, payment, order_id, consumer, message_id])
            claimed, recorded = cursor.fetchone()
        if not claimed:
            return False, None
        return True, None if recorded else spent_by(payment)


#: The claim-and-spend statement's text, by (database alias, inbox partitioned).
_claims: dict[tuple[str, bool], str] = {}


def claim_and_spend_sql(inbox_sql: str) -> str:
    """The statement that runs ``inbox_sql`` (an inbox ``INSERT ... ON CONFLICT
    DO NOTHING``) and, when it inserted the row, records the spent payment (four more
    arguments: the payment id, the order, the consumer, the message id). It returns one
    row, ``(claimed, recorded)``, each 0 or 1."""
    return (
        f"WITH new_inbox AS ({inbox_sql} RETURNING 1),"
        f" {spent_after('new_inbox', ['%s'] * 4)}"
        " SELECT (SELECT count(*) FROM new_inbox), (SELECT count(*) FROM spent)"
    )


def spent_after(claim: str, values: Sequence[str]) -> str:
    """The ``spent`` clause of a ``WITH`` that records the payment (``values``:
    the payment id, the order, the consumer, the message id) when the clause ``claim``
    inserted the inbox row; a payment spent already inserts nothing."""
    table, columns = spent_table()
    return (
        f"spent AS (INSERT INTO {table} ({', '.join(columns)})"
        f" SELECT {', '.join(values)} WHERE EXISTS (SELECT 1 FROM {claim})"
        f" ON CONFLICT ({columns[0]}) DO NOTHING RETURNING 1)"
    )


#: libpq's PQTRANS_IDLE: no transaction open on the connection.
_IDLE = 0

#: A statement of a text: as it is (``%s`` arguments; None: only named), its arguments
#: named (``%(a0)s``), and its arguments.
Statement = tuple[str | None, str, Sequence[Any]]
_named_forms: dict[str, str] = {}


def named(sql: str) -> str:
    """``sql`` with its ``%s`` arguments named by position, as prepared statements take them."""
    found = _named_forms.get(sql)
    if found is None:
        count = iter(range(sql.count("%s")))
        found = _named_forms[sql] = re.sub(
            r"%s|%%", lambda m: m[0] if m[0] == "%%" else f"%(a{next(count)})s", sql
        )
    return found


def send_text(conn: Any, cursor: Any, head: str, statements: Sequence[Statement], tail: str) -> int:
    """Send ``head``, ``statements`` and ``tail`` as one text, each statement as ``EXECUTE`` of
    a prepared statement of the session where it can
    (:func:`~idempotent_orders.prepared.execute_text`); the number of results before the
    first statement's (its ``PREPARE``s). Through Django's cursor (something must see the
    SQL) they go as they are."""
    composed: list[tuple[str | None, str]] = []
    if not isinstance(cursor, CursorWrapper):
        for _, form, args in statements:
            one = execute_text(conn, form, args)
            if one is None:
                composed = []
                break
            composed.append(one)
    with conn.wrap_database_errors:
        if composed:
            prepares = [prepare for prepare, _ in composed if prepare is not None]
            executes = [execute for _, execute in composed]
            cursor.execute(head + "; ".join([*prepares, *executes]) + tail)
            return len(prepares)
        if len(statements) == 1 and statements[0][0] is None:
            _, form, args = statements[0]
            cursor.execute(head + form + tail, {f"a{n}": arg for n, arg in enumerate(args)})
            return 0
        text = head + "; ".join(str(sql) for sql, _, _ in statements) + tail
        cursor.execute(text, [arg for _, _, args in statements for arg in args])
        return 0


def send_first(conn: Any, block: Block, statements: Sequence[Statement], tail: str = "") -> None:
    """Send the first text of ``block``: its opening (``BEGIN`` first where the driver's
    transaction is not open yet), ``statements`` and ``tail``; ``block.cursor`` is left at
    the first statement's result."""
    opening = (*(["BEGIN"] if _begins(conn) else []), *block.opening)
    block.opened = True
    try:
        skipped = send_text(
            conn, block.cursor, "".join(f"{sql}; " for sql in opening), statements, tail
        )
        for _ in range(skipped + len(opening)):
            block.cursor.nextset()
    except BaseException as exc:
        # Refused before it was sent (an argument the driver cannot adapt, say): no
        # savepoint to roll back to. Whatever the server answered ran the opening.
        block.opened = _answered(exc)
        raw = conn.connection
        if block.nested and raw.autocommit and raw.pgconn.transaction_status == _IDLE:
            # Its BEGIN never ran: the caller's transaction is the driver's to open.
            raw.autocommit = False
        raise


def _begins(conn: Any) -> bool:
    """Whether the first text opens the transaction itself with ``BEGIN`` (the driver's
    autocommit switched on for it); else the driver sends its own ``BEGIN``, or the
    transaction is open already."""
    raw = conn.connection
    if raw.isolation_level is not None or raw.read_only is not None or raw.deferrable:
        return False
    if raw.pgconn.transaction_status != _IDLE:
        return False  # begun already (by the caller, or a lookup of the inbox's shape)
    # Idle: no round trip. Django's outermost atomic switches it back at its end.
    raw.autocommit = True
    return True


def _answered(exc: BaseException) -> bool:
    """Whether ``exc`` is the server's answer to a text (an error with a SQLSTATE), or a
    lost connection (whatever ran is gone with it), not the driver refusing to send it."""
    cause = exc.__cause__ if isinstance(exc, DatabaseError) and exc.__cause__ else exc
    return getattr(cause, "sqlstate", None) is not None or isinstance(exc, OperationalError)
