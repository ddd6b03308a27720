"""MariaDB and MySQL: ``INSERT IGNORE``, named locks, several statements a text through
mysqlclient's ``CLIENT.MULTI_STATEMENTS``; ``RETURNING`` on MariaDB alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import InterfaceError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper

from idempotent_orders.vendors import Vendor

__all__ = ["MySQL"]

#: "Server has gone away" and "lost connection during query".
_LOST_ERRORS = {2006, 2013}
#: A deadlock: the server rolled the transaction back.
_DEADLOCK = 1213
#: mysqlclient's ``CLIENT.MULTI_STATEMENTS``.
_MULTI_STATEMENTS = 1 << 16


class MySQL(Vendor):
    name = "mysql"
    claim_lock = "named"
    no_table = " FROM DUAL"

    def insert_ignoring(self, table: str, columns: str, conflict: str) -> tuple[str, str]:
        # MariaDB >= 10.5 returns only the rows IGNORE let through.
        return f"INSERT IGNORE INTO {table} ({columns})", ""

    def bytewise(self, column: str, value: str = "%s") -> str:
        return f"BINARY {column} = {value}"

    def connection_lost(self, error: Exception) -> bool:
        if not isinstance(error, (OperationalError, InterfaceError)):
            return False
        return bool(error.args) and error.args[0] in _LOST_ERRORS

    def rolled_back(self, error: Exception) -> bool:
        return (
            isinstance(error, OperationalError)
            and bool(error.args)
            and (error.args[0] == _DEADLOCK)
        )

    def isolation_problem(self, settings_dict: Mapping[str, Any]) -> str:
        # Both servers default to REPEATABLE READ: a re-read returns the first snapshot.
        options = settings_dict.get("OPTIONS") or {}
        level = str(options.get("isolation_level") or "repeatable read")
        if level.lower().replace("-", " ") == "read committed":
            return ""
        return f"it is MySQL/MariaDB at isolation level {level!r}"

    def several_statements(self, conn: BaseDatabaseWrapper) -> bool:
        conn.ensure_connection()
        return bool(getattr(conn.connection, "client_flag", 0) & _MULTI_STATEMENTS)

    def takes_several(self, cursor: Any) -> bool:
        return True

    def skip_results(self, cursor: Any, count: int) -> None:
        # mysqlclient reads (and raises) each result at nextset(); nextset() past the last
        # one would read the rows of the one before, so it is called ``count`` times. As
        # Django's cursor does, the errors it misfiles are integrity errors.
        from django.db import IntegrityError
        from MySQLdb import OperationalError as DriverOperationalError

        try:
            for _ in range(count):
                cursor.nextset()
        except DriverOperationalError as exc:
            if exc.args and exc.args[0] in getattr(cursor, "codes_for_integrityerror", ()):
                raise IntegrityError(*exc.args) from exc
            raise

    def returns_inserted(self, conn: BaseDatabaseWrapper) -> bool:
        return bool(getattr(conn, "mysql_is_mariadb", False))
