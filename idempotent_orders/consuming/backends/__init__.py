"""The database backends of the consume road: what differs between PostgreSQL, MariaDB and
SQLite, chosen once per connection.

The road (:mod:`~idempotent_orders.consuming.single`, :mod:`~idempotent_orders.consuming.batch`)
is the same on every database; where a database can do a step in fewer statements, the
road asks :func:`backend` for its :class:`Backend` and uses what it names:

- ``without_read``: the roads that apply a message before reading its order (a message
  with nothing of the project's to run), tried in order; each returns None to decline;
- ``send_at_once``: how :mod:`~idempotent_orders.consuming.backends.at_once` sends a
  message's statements as one transaction (MariaDB and SQLite);
- ``two_texts``: how a message the roads without a read decline is claimed and read in
  one text, and written and committed in a second
  (:mod:`~idempotent_orders.consuming.backends.claim_and_run`);
- the statements' spelling: inserting while skipping duplicates, comparing text
  bytewise, one array per column (PostgreSQL's ``unnest``);
- the features that change the plan: whether a batch locks its orders before it claims,
  where ``ORDER BY`` puts NULL, whether a lost connection may hide a commit.

A backend holds no state of its own beyond what it reads once from the connection; the
instance is shared by every connection of its vendor.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from django.db import connection as default_connection
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.module_loading import import_string

__all__ = ["Backend", "Statements", "backend"]

#: A road that applies a message before its order is read: ``(envelope, consumer, model)``
#: to the outcome, or None when it declines (nothing written).
RoadWithoutRead = Callable[[Any, str, Any], Any]
#: A message's statements for :meth:`Backend.send_at_once`: ``(step, sql, args)``.
Statements = Sequence[tuple[str, str, Sequence[Any]]]


class Backend:
    """What the consume road needs to know of one database vendor (portable defaults)."""

    vendor = ""
    #: The roads that skip the order's read, as ``module:function`` under
    #: ``idempotent_orders.consuming``, tried in order (see :meth:`roads_without_read`).
    without_read: tuple[str, ...] = ()
    #: Statements take one array per column (``unnest``, ``= ANY``), one text for any
    #: number of rows.
    arrays = False
    #: A message's writes go in one statement (data-modifying ``WITH`` clauses): the
    #: inbox claim and the spent payment, or the claim and the order's UPDATE.
    one_statement = False
    #: The inbox may be partitioned by time (then no unique index spans it).
    partitions = False
    #: A batch locks its orders before it claims their inbox rows: the database checks a
    #: foreign key at once, share-locking the order the inbox row points to.
    locks_orders_first = False
    #: ``ORDER BY`` puts NULL after every value.
    nulls_last = False
    #: The road without a read is :mod:`~idempotent_orders.consuming.backends.at_once`'s: a
    #: message's statements sent as one transaction of their own (:meth:`send_at_once`),
    #: the state tested against each source of the transition.
    at_once = False
    #: The most digits a decimal column keeps exactly (None: what it declares).
    exact_decimal_digits: int | None = None
    #: How :mod:`~idempotent_orders.consuming.backends.claim_and_run` sends its two texts,
    #: as ``module:class`` under ``idempotent_orders.consuming`` ("": not at all).
    two_texts = ""

    def __init__(self) -> None:
        self._roads: list[tuple[Any, str]] | None = None
        self._texts: list[Any] = []

    def texts(self) -> Any:
        """The :class:`~idempotent_orders.consuming.backends.claim_and_run.Texts` that
        ``two_texts`` names (one instance), or None."""
        if not self._texts:
            self._texts.append(_named(self.two_texts)() if self.two_texts else None)
        return self._texts[0]

    def roads_without_read(self) -> list[RoadWithoutRead]:
        """The functions ``without_read`` names (their modules imported once; each function
        looked up by name, so a test may stand in for one)."""
        if self._roads is None:
            self._roads = [_module(path) for path in self.without_read]
        return [getattr(module, name) for module, name in self._roads]

    def insert_ignoring(self, table: str, columns: str, conflict: str) -> tuple[str, str]:
        """``(head, tail)`` of an INSERT into ``table`` (``columns``) that skips a row whose
        ``conflict`` columns are taken: ``f"{head} VALUES (...) {tail}"``."""
        return f"INSERT INTO {table} ({columns})", f"ON CONFLICT ({conflict}) DO NOTHING"

    def bytewise(self, column: str, value: str = "%s") -> str:
        """``column = value`` compared byte for byte, whatever the column's collation."""
        return f"{column} = {value}"

    def connection_lost(self, error: Exception) -> bool:
        """Whether ``error`` says the connection went away (a statement sent may have
        committed), not that the server refused or rolled something back."""
        return False

    def ready_at_once(self, conn: Any) -> bool:
        """Whether :meth:`send_at_once` may send on ``conn`` (outside any transaction)."""
        return self.at_once

    def send_at_once(
        self, conn: Any, statements: Statements, read: list[Any]
    ) -> tuple[bool, int | None]:
        """Send ``statements`` (``(step, sql, args)``: ``inbox``, ``spent``, ``source``,
        ``update``, ``read``, ``queue``) to ``conn``'s driver as one transaction of their
        own, the rows ``source`` and ``read`` fetch appended to ``read``; ``(applied,
        the outbox row's id or None)``. Not applied (rolled back, nothing written): the
        inbox row or the payment was taken, or the UPDATE matched no row."""
        raise NotImplementedError


def _module(path: str) -> tuple[Any, str]:
    """``module:name`` under ``idempotent_orders.consuming``: the module, imported, and the name."""
    module, _, name = path.partition(":")
    return importlib.import_module(f"idempotent_orders.consuming.{module}"), name


def _named(path: str) -> Any:
    module, name = _module(path)
    return getattr(module, name)


#: The backend of each vendor Django names (``connection.vendor``).
BACKENDS = {
    "postgresql": "idempotent_orders.consuming.backends.postgresql.PostgreSQL",
    "mysql": "idempotent_orders.consuming.backends.mysql.MySQL",
    "sqlite": "idempotent_orders.consuming.backends.sqlite.SQLite",
}

_chosen: dict[str, Backend] = {}


def backend(conn: BaseDatabaseWrapper | None = None) -> Backend:
    """The backend of ``conn`` (the default connection), chosen once per vendor."""
    vendor = (conn or default_connection).vendor
    found = _chosen.get(vendor)
    if found is None:
        path = BACKENDS.get(vendor)
        # Another database: the ORM road alone.
        chosen: type[Backend] = import_string(path) if path else Backend
        found = _chosen[vendor] = chosen()
    return found
