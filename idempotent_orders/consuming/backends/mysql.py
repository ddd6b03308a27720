"""MariaDB and MySQL: a message's writes before its order is read, as one multi-statement
text; a message that runs the project's code in two texts (its read in the first)."""

from __future__ import annotations

from django.db import InterfaceError, OperationalError

from idempotent_orders.consuming.backends import Backend

__all__ = ["MySQL"]

#: "Server has gone away" and "lost connection during query".
_LOST_ERRORS = {2006, 2013}


class MySQL(Backend):
    vendor = "mysql"
    without_read = (
        "backends.at_once:apply_unread_at_once",
        "backends.claim_and_run:claim_and_run",
    )
    two_texts = "backends.mysql_texts:MySQLTexts"
    locks_orders_first = True
    at_once = True
    at_once_in_one_text = True

    def insert_ignoring(self, table: str, columns: str, conflict: str) -> tuple[str, str]:
        # MariaDB >= 10.5 returns only the rows IGNORE let through.
        return f"INSERT IGNORE INTO {table} ({columns})", ""

    def bytewise(self, column: str, value: str = "%s") -> str:
        return f"BINARY {column} = {value}"

    def connection_lost(self, error: Exception) -> bool:
        if not isinstance(error, (OperationalError, InterfaceError)):
            return False
        return bool(error.args) and error.args[0] in _LOST_ERRORS
