"""SQLite: a message's statements before its order is read, straight to the driver between
BEGIN and COMMIT."""

from __future__ import annotations

from idempotent_orders.consuming.backends import Backend

__all__ = ["SQLite"]


class SQLite(Backend):
    vendor = "sqlite"
    without_read = ("backends.at_once:apply_unread_at_once",)
    at_once = True
    #: A decimal column is compared as a double: up to 15 digits, two values of one scale
    #: are two doubles.
    exact_decimal_digits = 15

    def bytewise(self, column: str, value: str = "%s") -> str:
        return f"{column} = {value} COLLATE BINARY"
