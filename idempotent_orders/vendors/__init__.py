"""The databases the app runs on: what differs between PostgreSQL, MariaDB and SQLite,
for every room of the app, chosen once per vendor.

A room asks :func:`vendor` for its connection's :class:`Vendor` and uses what it names:
never ``connection.vendor`` itself (``tests/project/test_structure.py`` keeps it so). The
consume road's backends (:mod:`idempotent_orders.consuming.backends`) build on these
classes with what only the consume road needs. Each class holds no state beyond what it
reads from a connection; one instance serves every connection of its vendor.

The portable defaults (:class:`Vendor` itself) are what the app assumes of a database it
has no class for: ``INSERT ... ON CONFLICT DO NOTHING``, one statement a text, key
quotas counted and then inserted. They are not run against any such database here;
``manage.py check`` warns where the app's tables are on one (W032).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar

from django.db import connection as default_connection
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.module_loading import import_string

__all__ = ["Chooser", "ClaimLock", "Vendor", "vendor"]

V = TypeVar("V", bound="Vendor")

#: How a principal's key claims are kept apart while its live keys are counted against
#: its quota (:mod:`idempotent_orders.http.claim_sql`): ``advisory``, a lock held to the
#: end of the claim's transaction; ``named``, a named lock around the claim's statement;
#: ``writer``, the database's single writer; ``""``, not at all (counted, then inserted).
ClaimLock = Literal["advisory", "named", "writer", ""]


class Vendor:
    """What one database vendor does differently (portable defaults)."""

    #: Django's name of the vendor (``connection.vendor``); "" for the portable defaults.
    name = ""
    #: The inbox may be partitioned by time (declarative partitioning).
    partitions = False
    #: ``ORDER BY`` puts NULL after every value.
    nulls_last = False
    #: Many values of a column go as one array parameter (``unnest``, ``= ANY``).
    arrays = False
    #: ``LISTEN``/``NOTIFY``: a waiting relay is woken by the outbox's insert trigger.
    notifies = False
    #: How a principal's key claims are kept apart (see :data:`ClaimLock`).
    claim_lock: ClaimLock = ""
    #: The outbox table's JSON columns take this literal for an empty list.
    empty_json_list = "'[]'"
    #: ``WITH x AS (INSERT/UPDATE ... RETURNING ...)``: a statement's writes feed its query.
    writes_in_with = False
    #: A statement's error aborts the whole transaction (until it is rolled back to a
    #: savepoint), not the statement alone.
    error_aborts_transaction = False
    #: What a ``SELECT`` of no table adds before its ``WHERE`` (``FROM DUAL``).
    no_table = ""
    #: Statements may be prepared once per session (``PREPARE``/``EXECUTE``, kept by
    #: :mod:`idempotent_orders.prepared`).
    prepares = False

    def bytewise(self, column: str, value: str = "%s") -> str:
        """``column = value`` compared byte for byte, whatever the column's collation."""
        return f"{column} = {value}"

    def insert_ignoring(self, table: str, columns: str, conflict: str) -> tuple[str, str]:
        """``(head, tail)`` of an INSERT into ``table`` (``columns``) that skips a row whose
        ``conflict`` columns are taken: ``f"{head} VALUES (...) {tail}"``."""
        return f"INSERT INTO {table} ({columns})", f"ON CONFLICT ({conflict}) DO NOTHING"

    def connection_lost(self, error: Exception) -> bool:
        """Whether ``error`` says the connection went away (a statement sent may have
        committed), not that the server refused or rolled something back."""
        return False

    def rolled_back(self, error: Exception) -> bool:
        """Whether ``error`` says the database rolled the whole transaction back to break a
        race (a serialization failure, a deadlock): nothing of it was written, and it may
        simply run again."""
        return False

    def isolation_problem(self, settings_dict: Mapping[str, Any]) -> str:
        """What keeps a connection configured by ``settings_dict`` from reading, on a
        second read in one transaction, what others committed since its first: a re-read
        after a lost race must see the winner ("" when nothing does)."""
        return ""

    def several_statements(self, conn: BaseDatabaseWrapper) -> bool:
        """Whether one text sent on ``conn`` may hold several statements, each result read
        in turn (``cursor.nextset()``)."""
        return False

    def aborted(self, conn: BaseDatabaseWrapper) -> bool:
        """Whether the transaction open on ``conn`` can no longer commit: an error aborted
        it and the code that met the error caught it (its ``COMMIT`` would roll back)."""
        return False

    def takes_several(self, cursor: Any) -> bool:
        """Whether the driver's ``cursor`` (``CursorWrapper.cursor``) may send a text of
        several statements, given :meth:`several_statements` of its connection."""
        return False

    def skip_results(self, cursor: Any, count: int) -> None:
        """Move the driver's ``cursor``, which sent a text of several statements, past the
        results of the first ``count`` to the next one's: the one ``fetch*``, ``rowcount``
        and ``lastrowid`` then read. Raises what a statement skipped raised, as Django's
        cursor would have raised it."""
        raise NotImplementedError

    def returns_inserted(self, conn: BaseDatabaseWrapper) -> bool:
        """Whether ``INSERT ... RETURNING`` gives back the rows inserted, none for a row an
        ``ON CONFLICT DO NOTHING`` or ``IGNORE`` skipped."""
        return False

    def returns_updated(self, conn: BaseDatabaseWrapper) -> bool:
        """Whether ``UPDATE ... RETURNING`` gives back the rows updated."""
        return False

    def estimated_rows(
        self, conn: BaseDatabaseWrapper, sql: str, params: Sequence[Any]
    ) -> int | None:
        """The planner's estimate of the rows ``sql`` returns, or None (count them)."""
        return None

    def lock_until_commit(self, conn: BaseDatabaseWrapper, key: int) -> None:
        """Hold the lock ``key`` until ``conn``'s transaction ends (others asking for it
        wait); nothing where the database has no such lock."""

    def relax_commit(self, conn: BaseDatabaseWrapper) -> None:
        """Let ``conn``'s transaction commit without waiting for its write to reach disk:
        for writes whose loss in a server crash only repeats work (a relay's marks)."""


class Chooser(Generic[V]):
    """Called with a connection: one instance a vendor of the class ``paths`` names for it
    (by :attr:`Vendor.name`, Django's ``connection.vendor``), ``portable``'s for another
    database; made once, on first use."""

    def __init__(self, paths: Mapping[str, str], portable: type[V]) -> None:
        self.paths = paths
        self.portable = portable
        self._chosen: dict[str, V] = {}

    def __call__(self, conn: BaseDatabaseWrapper | None = None) -> V:
        return self.named((conn or default_connection).vendor)

    def named(self, name: str) -> V:
        """The instance for the vendor Django calls ``name``."""
        found = self._chosen.get(name)
        if found is None:
            path = self.paths.get(name)
            found = self._chosen[name] = import_string(path)() if path else self.portable()
        return found

    def each(self) -> list[V]:
        """One instance of every vendor the chooser has a class for."""
        return [self.named(name) for name in self.paths]


#: The vendor of each name Django gives (``connection.vendor``).
VENDORS = {
    "postgresql": "idempotent_orders.vendors.postgresql.PostgreSQL",
    "mysql": "idempotent_orders.vendors.mysql.MySQL",
    "sqlite": "idempotent_orders.vendors.sqlite.SQLite",
}

#: The :class:`Vendor` of a connection (the default one without): ``vendor(connection)``.
vendor = Chooser(VENDORS, Vendor)
