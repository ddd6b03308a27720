"""SQLite: a message's statements before its order is read, straight to the driver between
BEGIN and COMMIT."""

from __future__ import annotations

import contextlib
from typing import Any

from django.db import IntegrityError

from idempotent_orders.consuming.backends import Backend, Statements
from idempotent_orders.prepared import watched
from idempotent_orders.vendors import sqlite

__all__ = ["SQLite"]


class SQLite(sqlite.SQLite, Backend):
    without_read = ("backends.at_once:apply_unread_at_once",)
    at_once = True
    #: A decimal column is compared as a double: up to 15 digits, two values of one scale
    #: are two doubles.
    exact_decimal_digits = 15

    def send_at_once(
        self, conn: Any, statements: Statements, read: list[Any]
    ) -> tuple[bool, int | None]:
        # BEGIN with the database's own ``transaction_mode``; SQLite's transaction holds
        # the write lock, so the order's state read before the UPDATE needs no lock.
        mode = getattr(conn, "transaction_mode", None)
        queued_id: int | None = None
        conn.ensure_connection()
        # Straight to the driver unless something must see the queries (prepared.watched):
        # Django's cursor wrapper costs more than a statement here.
        seen = watched(conn)
        if not seen:
            conn.validate_thread_sharing()
        with (
            conn.cursor() if seen else contextlib.closing(conn.connection.cursor()) as cursor,
            conn.wrap_database_errors,
        ):
            cursor.execute(f"BEGIN {mode}" if mode else "BEGIN")
            refused = (IntegrityError, conn.Database.IntegrityError)
            try:
                for step, sql, args in statements:
                    try:
                        cursor.execute(sql if seen else _qmark(sql), args)
                    except refused:
                        if step not in ("inbox", "spent"):
                            raise
                        cursor.execute("ROLLBACK")
                        return False, None
                    if step == "update" and cursor.rowcount != 1:
                        cursor.execute("ROLLBACK")
                        return False, None
                    if step == "queue":
                        queued_id = cursor.lastrowid if cursor.rowcount == 1 else None
                    elif step in ("source", "read"):
                        read.append(cursor.fetchone())
                cursor.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(Exception):
                    cursor.execute("ROLLBACK")
                raise
        return True, queued_id


_qmarks: dict[str, str] = {}


def _qmark(sql: str) -> str:
    """``sql`` with sqlite3's own placeholders (the texts here hold no other ``%``)."""
    found = _qmarks.get(sql)
    if found is None:
        found = _qmarks[sql] = sql.replace("%s", "?")
    return found
