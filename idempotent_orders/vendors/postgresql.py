"""PostgreSQL: partitions, arrays, ``LISTEN``/``NOTIFY``, advisory locks, data-modifying
``WITH`` clauses, and several statements a text through psycopg 3's client-side binding."""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from idempotent_orders.vendors import Vendor

__all__ = ["PostgreSQL"]

#: SQLSTATEs of a connection that went away (class 08, and the server shutting down).
_LOST_SQLSTATE_PREFIXES = ("08", "57P01", "57P02", "57P03")
#: SQLSTATEs of a transaction rolled back to break a race: a serialization failure, a
#: deadlock.
_ROLLED_BACK_SQLSTATES = {"40001", "40P01"}
#: libpq's transaction status of a transaction an error aborted (``PQTRANS_INERROR``).
_INERROR = 3


class PostgreSQL(Vendor):
    name = "postgresql"
    partitions = True
    nulls_last = True
    arrays = True
    notifies = True
    claim_lock = "advisory"
    empty_json_list = "'[]'::jsonb"
    writes_in_with = True
    prepares = True
    error_aborts_transaction = True

    def bytewise(self, column: str, value: str = "%s") -> str:
        return f'{column} = {value} COLLATE "C"'

    def connection_lost(self, error: Exception) -> bool:
        if not isinstance(error, (OperationalError, InterfaceError)):
            return False
        sqlstate = getattr(error.__cause__, "sqlstate", None)
        # No SQLSTATE: psycopg's own error, the server never answered.
        return sqlstate is None or sqlstate.startswith(_LOST_SQLSTATE_PREFIXES)

    def rolled_back(self, error: Exception) -> bool:
        return getattr(error.__cause__, "sqlstate", None) in _ROLLED_BACK_SQLSTATES

    def several_statements(self, conn: BaseDatabaseWrapper) -> bool:
        # psycopg 3's client-side binding cursors (Django's default) send a simple query,
        # which may hold several statements; server-side binding, or psycopg2, does not.
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        if not is_psycopg3:
            return False
        import psycopg

        conn.ensure_connection()
        return issubclass(conn.connection.cursor_factory, psycopg.ClientCursor)

    def aborted(self, conn: BaseDatabaseWrapper) -> bool:
        # Any error aborts the whole transaction, and the server answers its COMMIT with
        # a ROLLBACK the driver does not raise.
        raw = conn.connection
        if raw is None:
            return False
        pgconn = getattr(raw, "pgconn", None)  # psycopg 3; psycopg2 asks the connection
        status = pgconn.transaction_status if pgconn is not None else raw.get_transaction_status()
        return bool(status == _INERROR)

    def takes_several(self, cursor: Any) -> bool:
        # A server-side (named) cursor declares its one query.
        import psycopg

        return isinstance(cursor, psycopg.ClientCursor)

    def skip_results(self, cursor: Any, count: int) -> None:
        # psycopg 3 read every result (and raised any error) in execute().
        for _ in range(count):
            cursor.nextset()

    def returns_inserted(self, conn: BaseDatabaseWrapper) -> bool:
        return True

    def returns_updated(self, conn: BaseDatabaseWrapper) -> bool:
        return True

    def estimated_rows(
        self, conn: BaseDatabaseWrapper, sql: str, params: Sequence[Any]
    ) -> int | None:
        # In a transaction (``ATOMIC_REQUESTS``) a savepoint around it: a failed EXPLAIN
        # (a statement timeout, say) must not leave the request's transaction aborted.
        around = transaction.atomic(using=conn.alias) if conn.in_atomic_block else nullcontext()
        try:
            with around, conn.cursor() as cursor:
                cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
                plan = cursor.fetchone()[0]
        except DatabaseError:
            return None
        if isinstance(plan, str):
            plan = json.loads(plan)
        return int(plan[0]["Plan"]["Plan Rows"])

    def lock_until_commit(self, conn: BaseDatabaseWrapper, key: int) -> None:
        with conn.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [key])

    def relax_commit(self, conn: BaseDatabaseWrapper) -> None:
        with conn.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit TO OFF")
