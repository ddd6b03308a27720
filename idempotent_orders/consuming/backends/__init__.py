"""The database backends of the consume road: what differs between PostgreSQL, MariaDB and
SQLite on it, chosen once per vendor. Each builds on its vendor's
:class:`~idempotent_orders.vendors.Vendor` (what differs for every room of the app: how
to insert skipping duplicates, compare bytewise, sort NULL, tell a lost connection).

The road (:mod:`~idempotent_orders.consuming.single`, :mod:`~idempotent_orders.consuming.batch`)
is the same on every database; where a database can do a step in fewer statements, the
road asks :func:`backend` for its :class:`Backend` and uses what it names:

- ``without_read``: the roads that apply a message before reading its order (a message
  with nothing of the project's to run), tried in order; each returns None to decline;
- ``send_at_once``: how :mod:`~idempotent_orders.consuming.backends.at_once` sends a
  message's statements as one transaction (MariaDB and SQLite);
- ``two_texts``: how the road after the read sends a message's statements in two texts
  (its :class:`Texts`): the claim with the read, then the write with ``COMMIT`` (or,
  inside a caller's transaction, with the release of the message's savepoint:
  :func:`atomic_block`);
- a batch chunk's filter of its orders, its one UPDATE of many orders and its spent
  payments (PostgreSQL's: one array per column, ``unnest``);
- the features that change the plan: whether a batch locks its orders before it claims.

A backend holds no state of its own beyond what it reads once from the connection; the
instance is shared by every connection of its vendor.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from django.db import connections, router, transaction
from django.db.models import Field, Model, Q
from django.db.models.manager import BaseManager

from idempotent_orders.prepared import watched
from idempotent_orders.vendors import Chooser, Vendor

__all__ = [
    "Backend",
    "Block",
    "Declined",
    "FirstText",
    "Statements",
    "Texts",
    "atomic_block",
    "backend",
]

#: A road that applies a message before its order is read: ``(envelope, consumer, model)``
#: to the outcome, or None when it declines (nothing written).
RoadWithoutRead = Callable[[Any, str, Any], Any]
#: A message's statements for :meth:`Backend.send_at_once`: ``(step, sql, args)``.
Statements = Sequence[tuple[str, str, Sequence[Any]]]


class Declined(Exception):
    """The first text found the message is not the two texts' to apply: roll back, the
    road reads and decides on its own."""


@dataclass(frozen=True)
class FirstText:
    """What the first text claims and reads."""

    #: The inbox row's per-message fields.
    inbox: dict[str, Any]
    #: The spent payment's row (payment, order, consumer, message id); None: no payment.
    spent: list[Any] | None
    #: The order's read and its arguments.
    read: str
    read_args: Sequence[Any]


@dataclass
class Block:
    """The two texts' transaction (:meth:`Texts.transaction`): the cursor both texts go
    through, and the statements that open the block at the head of the first text and
    end it at the end of the last."""

    cursor: Any = None
    #: Inside a caller's transaction: the block is Django's savepoint (:func:`atomic_block`).
    nested: bool = False
    opening: tuple[str, ...] = ()
    closing: tuple[str, ...] = ()
    #: The first text went out (its opening with it).
    opened: bool = False
    #: A text that ends with the closing ran whole.
    closed: bool = False


@contextmanager
def atomic_block(conn: Any) -> Iterator[Block]:
    """Django's ``atomic`` block of the two texts, as a :class:`Block` whose ``opening``
    and ``closing`` the backend fills in (its transaction's own), except inside a
    caller's transaction.

    There Django opens the block with a savepoint and ends it with the savepoint's
    release, or a rollback to it, each a round trip of its own: here the savepoint's
    statement is held back for the head of the first text (``opening``), and its release
    goes at the end of the text that ends the block (``closing``). Django sends the end it
    would have sent unless the last text released the savepoint already, or the first
    text never went out (then there is none); its rollback to the savepoint takes the
    release with it, in one text. Django's bookkeeping is its own as ever:
    the savepoint ids, and the ``on_commit`` callbacks dropped with a rolled-back
    savepoint. Where something must see the statements
    (:func:`~idempotent_orders.prepared.watched`), Django sends them itself."""
    atomic = transaction.atomic(using=conn.alias)
    if not conn.in_atomic_block:
        with atomic:
            yield Block()
        return
    if watched(conn):
        # Something must see the statements (DEBUG, a toolbar, a test capturing them):
        # Django sends the savepoint's as ever, in round trips of their own.
        with atomic:
            yield Block(nested=True, opened=True)
        return
    held: list[str] = []

    def hold(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if not held and params is None and sql.startswith("SAVEPOINT "):
            held.append(sql)
            return None
        return execute(sql, params, many, context)

    with conn.execute_wrapper(hold):
        atomic.__enter__()
    sid = conn.savepoint_ids[-1]
    block = Block(nested=True, opening=tuple(held))
    rollback = release = ""
    if sid is not None:
        rollback, release = conn.ops.savepoint_rollback_sql(sid), conn.ops.savepoint_commit_sql(sid)
        block.closing = (release,)
    if held and (sid is None or held[0] != conn.ops.savepoint_create_sql(sid)):
        with conn.cursor() as cursor:  # not the block's savepoint: sent as Django would
            cursor.execute(held[0])
        block.opening, block.opened = (), True

    def end(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if not sql or sql not in (rollback, release):
            return execute(sql, params, many, context)
        if not block.opened or block.closed:
            return None  # a savepoint never made, or released by the last text
        if sql == release:
            return execute(sql, params, many, context)
        # Django releases the savepoint right after it rolled back to it: one text.
        done = execute(f"{rollback}; {release}", params, many, context)
        while context["cursor"].nextset():
            pass
        block.closed = True
        return done

    try:
        yield block
    except BaseException:
        with conn.execute_wrapper(end):
            atomic.__exit__(*sys.exc_info())
        raise
    with conn.execute_wrapper(end):
        atomic.__exit__(None, None, None)


class Texts:
    """How one database sends a message's statements in two texts (a backend's
    ``two_texts``): the claim with the read, then the write with ``COMMIT`` (inside a
    caller's transaction, the release of the message's savepoint)."""

    def transaction(self, conn: Any) -> AbstractContextManager[Block]:
        """Django's ``atomic`` block of the road (:func:`atomic_block`), its cursor and the
        statements that open and end it."""
        raise NotImplementedError

    def claim_and_read(self, conn: Any, block: Block, first: FirstText) -> Sequence[Any]:
        """The first text: open the block, claim the message as applied and spend its
        payment, read the order (:class:`FirstText`); the order's row. Raises
        :class:`Declined` for a duplicate, a spent payment, an unknown order, a value a
        column refuses."""
        raise NotImplementedError

    def compile(self, conn: Any, update: str, queued: bool, closes: bool) -> Any:
        """The second text of one shape of transition: the conditional ``update``
        (:func:`~idempotent_orders.consuming.running.guarded_update_sql`), the follow-up's
        outbox row when ``queued``, the block's end when ``closes``; it stops before the
        end when the UPDATE matched no row."""
        raise NotImplementedError

    def write(
        self, conn: Any, block: Block, update: Any, args: list[Any], queued: dict[str, Any] | None
    ) -> int | None:
        """Send ``update`` (from :meth:`compile`) with the UPDATE's ``args`` and the
        follow-up's ``queued`` fields; the outbox row's id (None: none written, its
        message id was queued already). Raises :class:`Declined` when the order moved."""
        raise NotImplementedError

    #: The UPDATE of the model's own ``save()`` can be held back for the next text
    #: (:mod:`~idempotent_orders.consuming.held`): :meth:`queue` takes it, and
    #: :meth:`held_prefix` sends it before the project's next statement.
    holds_save_update = False

    def queue(
        self,
        conn: Any,
        block: Block,
        queued: dict[str, Any],
        held: tuple[str, list[Any]] | None = None,
    ) -> int | None:
        """Send the follow-up's outbox row of ``queued`` fields and the block's end as one
        text, the order written by the model's own ``save()``: before now, or by ``held``
        (its UPDATE and arguments) at the head of this text, which stops before the end
        (raising :class:`Declined`) when that UPDATE matched no row. The row's id (None:
        its message id was queued already). An insert that fails stops the text before
        the end."""
        raise NotImplementedError

    def held_prefix(self, conn: Any, update: str, params: list[Any], stop: bool = False) -> str:
        """The held ``update`` with its ``params`` written in as literals: the head of the
        text of the project's next statement. ``stop``: where the database runs a text's
        statements until the first error and raises it at once, an UPDATE that matched no
        row stops the text with an error (:meth:`held_unanswered` tells it)."""
        raise NotImplementedError

    def held_unanswered(self, exc: BaseException) -> bool:
        """A text that carried held UPDATEs (made with ``stop``) raised ``exc`` before
        their rows were read: whether one of them may have matched no row (else each ran
        and matched, and the error is a later statement's)."""
        raise NotImplementedError

    def held_rows(self, conn: Any, cursor: Any, matched: Callable[[int], None]) -> None:
        """After a text that :meth:`held_prefix` opened: ``matched`` with the rows the held
        UPDATE matched (before any error of the project's statement is raised), then
        ``cursor`` left on the project's statement's result."""
        raise NotImplementedError


class Backend(Vendor):
    """What the consume road needs to know of one database vendor (portable defaults)."""

    #: The roads that skip the order's read, as ``module:function`` under
    #: ``idempotent_orders.consuming``, tried in order (see :meth:`roads_without_read`).
    without_read: tuple[str, ...] = ()
    #: They run inside a caller's transaction too, in the message's savepoint
    #: (:func:`atomic_block`); else they decline there.
    unread_in_savepoint = False
    #: A batch locks its orders before it claims their inbox rows: the database checks a
    #: foreign key at once, share-locking the order the inbox row points to.
    locks_orders_first = False
    #: The road without a read is :mod:`~idempotent_orders.consuming.backends.at_once`'s: a
    #: message's statements sent as one transaction of their own (:meth:`send_at_once`),
    #: the state tested against each source of the transition.
    at_once = False
    #: The most digits a decimal column keeps exactly (None: what it declares).
    exact_decimal_digits: int | None = None
    #: How the road sends a message's statements in two texts (:class:`Texts`), as
    #: ``module:class`` under ``idempotent_orders.consuming`` ("": one at a time).
    two_texts = ""

    def __init__(self) -> None:
        self._roads: list[tuple[Any, str]] | None = None
        self._texts: list[Any] = []

    def texts(self) -> Any:
        """The :class:`Texts` that ``two_texts`` names (one instance), or None."""
        if not self._texts:
            self._texts.append(_named(self.two_texts)() if self.two_texts else None)
        return self._texts[0]

    def roads_without_read(self) -> list[RoadWithoutRead]:
        """The functions ``without_read`` names (their modules imported once; each function
        looked up by name, so a test may stand in for one)."""
        if self._roads is None:
            self._roads = [_module(path) for path in self.without_read]
        return [getattr(module, name) for module, name in self._roads]

    def pk_in(self, model: type[Model], ids: set[Any]) -> Any:
        """The filter of ``model``'s rows whose primary key is one of ``ids``."""
        return Q(pk__in=ids)

    def update_orders(
        self,
        model: type[Model],
        changed: Mapping[Any, Mapping[str, Any]],
        read_version: Mapping[Any, int],
        names: Sequence[str],
    ) -> int | None:
        """A batch chunk's one UPDATE of many orders: ``changed`` (per order pk, the new value
        of each changed field) written to the orders still at their ``read_version``; the
        number of rows it matched. None (nothing sent) where the ORM must write: a default
        manager with its own ``get_queryset``, a field of another table (multi-table
        inheritance), a value that is an expression.

        ``UPDATE <order> SET <column> = CASE <pk> WHEN :pk THEN :value ... ELSE <column>
        END, ... WHERE (<pk> = :pk AND version = :version) OR ...``: what ``update()`` with
        a ``Case`` of one ``When`` per order sends, without compiling that expression for
        every message (at 200 orders the compile cost more than the chunk's statements).
        """
        if type(model._default_manager).get_queryset is not BaseManager.get_queryset:
            return None
        if any(
            hasattr(v, "resolve_expression") for values in changed.values() for v in values.values()
        ):
            return None  # an expression: the ORM compiles it
        meta = model._meta
        pk = meta.pk
        assert pk is not None
        fields: list[Field[Any, Any]] = []
        for name in names:
            field = meta.get_field(name)
            if not isinstance(field, Field) or field.model._meta.db_table != meta.db_table:
                return None
            fields.append(field)
        version = meta.get_field("version")
        assert isinstance(version, Field)
        if pk.model._meta.db_table != meta.db_table:
            return None
        conn = connections[router.db_for_write(model)]
        qn = conn.ops.quote_name
        pk_column = qn(str(pk.column))
        sets: list[str] = []
        params: list[Any] = []
        for field in fields:
            column = qn(str(field.column))
            arms = []
            for key, values in changed.items():
                if field.name in values:
                    arms.append("WHEN %s THEN %s")
                    params += [
                        pk.get_db_prep_value(key, conn),
                        field.get_db_prep_save(values[field.name], conn),
                    ]
            sets.append(f"{column} = CASE {pk_column} {' '.join(arms)} ELSE {column} END")
        version_column = qn(str(version.column))
        where = " OR ".join([f"({pk_column} = %s AND {version_column} = %s)"] * len(changed))
        for key in changed:
            params += [pk.get_db_prep_value(key, conn), read_version[key]]
        sql = f"UPDATE {qn(meta.db_table)} SET {', '.join(sets)} WHERE {where}"
        with conn.cursor() as cursor:
            cursor.execute(sql, params)
            return int(cursor.rowcount)

    def record_spent(
        self, consumer: str, rows: Sequence[tuple[str, Any, str]], skip_spent: bool
    ) -> set[str] | None:
        """Record many payments in one statement (see
        :func:`~idempotent_orders.consuming.payments.record_spent`); the ids inserted, or
        None with nothing sent (the ORM writes them)."""
        return None

    def claim_and_spend(
        self, values: Mapping[str, Any], now: Any, payment: str, order_id: Any
    ) -> tuple[bool, Any | None] | None:
        """The inbox row (``values``, its per-message columns) and the spent payment in one
        statement, in the caller's transaction: ``(claimed, owner)``, ``claimed`` False
        when the inbox holds the message already (nothing written), ``owner`` the order the
        payment was spent on before (None: recorded). None with nothing sent: the claim
        and the payment go one statement each."""
        return None

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


#: The backend of each vendor (:attr:`~idempotent_orders.vendors.Vendor.name`).
BACKENDS = {
    "postgresql": "idempotent_orders.consuming.backends.postgresql.PostgreSQL",
    "mysql": "idempotent_orders.consuming.backends.mysql.MySQL",
    "sqlite": "idempotent_orders.consuming.backends.sqlite.SQLite",
}

#: The backend of a connection (the default one without), chosen once per vendor; another
#: database takes the ORM road alone.
backend = Chooser(BACKENDS, Backend)
