"""PostgreSQL: one statement for a message with nothing of the project's to run, two texts
for one that runs the project's code (its claim and spent payment in one statement, with
data-modifying ``WITH`` clauses), arrays for a batch's columns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.db import connection

from idempotent_orders.consuming.backends import Backend
from idempotent_orders.consuming.backends.postgresql.arrays import (
    any_of,
    record_spent,
    update_orders,
)
from idempotent_orders.consuming.payments import spent_by, spent_table
from idempotent_orders.consuming.sql import inbox_partitioned, inbox_template
from idempotent_orders.vendors import postgresql

__all__ = ["PostgreSQL", "claim_and_spend_sql", "spent_after"]


class PostgreSQL(postgresql.PostgreSQL, Backend):
    without_read = ("backends.postgresql.one_statement:apply_unread",)
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
