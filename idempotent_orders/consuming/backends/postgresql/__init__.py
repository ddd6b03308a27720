"""PostgreSQL: one statement for a message with nothing of the project's to run, two texts
for one that runs the project's code, arrays for a batch's columns."""

from __future__ import annotations

from django.db import InterfaceError, OperationalError

from idempotent_orders.consuming.backends import Backend

__all__ = ["PostgreSQL"]

#: SQLSTATEs of a connection that went away (class 08, and the server shutting down).
_LOST_SQLSTATE_PREFIXES = ("08", "57P01", "57P02", "57P03")


class PostgreSQL(Backend):
    vendor = "postgresql"
    without_read = (
        "backends.postgresql.one_statement:apply_unread",
        "backends.claim_and_run:claim_and_run",
    )
    two_texts = "backends.postgresql.texts:PostgreSQLTexts"
    arrays = True
    one_statement = True
    partitions = True
    nulls_last = True

    def bytewise(self, column: str, value: str = "%s") -> str:
        return f'{column} = {value} COLLATE "C"'

    def connection_lost(self, error: Exception) -> bool:
        if not isinstance(error, (OperationalError, InterfaceError)):
            return False
        sqlstate = getattr(error.__cause__, "sqlstate", None)
        # No SQLSTATE: psycopg's own error, the server never answered.
        return sqlstate is None or sqlstate.startswith(_LOST_SQLSTATE_PREFIXES)
