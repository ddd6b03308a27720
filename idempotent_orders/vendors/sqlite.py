"""SQLite: one writer at a time, ``RETURNING`` from 3.35."""

from __future__ import annotations

from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from idempotent_orders.vendors import Vendor

__all__ = ["SQLite"]


def _version(conn: BaseDatabaseWrapper) -> tuple[int, ...]:
    database: Any = getattr(conn, "Database", None)
    return tuple(getattr(database, "sqlite_version_info", (0,)))


class SQLite(Vendor):
    name = "sqlite"
    claim_lock = "writer"

    def bytewise(self, column: str, value: str = "%s") -> str:
        return f"{column} = {value} COLLATE BINARY"

    def returns_inserted(self, conn: BaseDatabaseWrapper) -> bool:
        return _version(conn) >= (3, 35)

    def returns_updated(self, conn: BaseDatabaseWrapper) -> bool:
        return _version(conn) >= (3, 35)
