"""MariaDB and MySQL: a message's writes before its order is read, as one multi-statement
text (:meth:`MySQL.send_at_once`); a message that runs the project's code in two texts
(:class:`MySQLTexts`). Both need mysqlclient's ``CLIENT.MULTI_STATEMENTS`` (on unless
``OPTIONS`` turns it off).

:meth:`MySQL.send_at_once`: ``START TRANSACTION; INSERT inbox; INSERT spent; UPDATE order;
<guard>; INSERT IGNORE outbox; COMMIT``. The server stops at the first statement that
fails, so a duplicate (the inbox's unique index), a spent payment (its unique index) or an
order the tests refuse (the guard fails when the UPDATE matched no row) never reaches
``COMMIT``; the transaction is rolled back and the usual road reads, decides and says why.

:class:`MySQLTexts`, the road's two texts
(:func:`~idempotent_orders.consuming.writing.apply`):

1. ``START TRANSACTION; SELECT <order> ... FOR UPDATE; INSERT <inbox>; [INSERT
   <spent payment>]``: the order is locked before the inbox row's foreign key
   share-locks it (as a batch locks its orders first), and a duplicate or a spent
   payment fails its unique index, which stops the text;
2. ``UPDATE <order> ... WHERE pk AND state AND version AND ...; <guard>; [INSERT IGNORE
   <outbox>]; COMMIT``: the guard fails (a scalar subquery of two rows) when the UPDATE
   matched no row, so ``COMMIT`` never runs; the road rolls back and the usual road
   decides again. On the save() road, the model's ``save()`` having written the order:
   ``[<save()'s UPDATE, held for this text>; <guard>;] INSERT IGNORE <outbox>; COMMIT``
   (:mod:`~idempotent_orders.consuming.held`).

Inside a caller's transaction the block is Django's savepoint
(:func:`~idempotent_orders.consuming.backends.atomic_block`): ``SAVEPOINT`` opens the
first text instead of ``START TRANSACTION`` and ``RELEASE SAVEPOINT`` ends the last
instead of ``COMMIT``. The order's row lock stays until the caller's transaction ends
(InnoDB keeps it through a rollback to the savepoint too).

Django's ``atomic`` block around them switches the session's autocommit off on entry
and on again on exit, a round trip each, and commits with a round trip of its own:
here ``START TRANSACTION`` opens the transaction instead (the session's autocommit left
as it is), and a second text that committed leaves Django's ``COMMIT`` nothing to send.
Django's own bookkeeping (``on_commit``, savepoints of the project's code) is the
block's as ever; where the ORM writes instead
(:func:`~idempotent_orders.consuming.writing.settle`), Django's ``COMMIT`` goes as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, DataError, IntegrityError
from django.db.models import Field
from django.utils import timezone

from idempotent_orders.consuming.backends import (
    Backend,
    Block,
    Declined,
    FirstText,
    Statements,
    Texts,
    atomic_block,
)
from idempotent_orders.consuming.backends.at_once import inserts
from idempotent_orders.consuming.sql import inbox_template
from idempotent_orders.prepared import watched
from idempotent_orders.vendors import mysql, vendor

__all__ = ["MySQL", "MySQLTexts"]

#: MySQL's error numbers for a duplicate key, and for the guard's scalar subquery
#: returning two rows.
_DUPLICATE_KEY = 1062
_GUARD_FAILED = 1242
#: The failures of a step that mean "declined": ``(MySQL error number, step)``.
_DECLINING = {(_DUPLICATE_KEY, "inbox"), (_DUPLICATE_KEY, "spent"), (_GUARD_FAILED, "guard")}
#: Fails (more than one row in a scalar subquery) unless the UPDATE before it matched
#: one row: the statements after it, ``COMMIT`` included, never run.
_GUARD = (
    "SELECT (SELECT 1 FROM (SELECT 1 AS one UNION ALL SELECT 2) AS io_guard"
    " WHERE ROW_COUNT() <> 1 AND one > 0)"
)


def _cursor(conn: Any) -> Any:
    """The driver's cursor of ``conn`` (connected) unless something must see the texts
    (:func:`~idempotent_orders.prepared.watched`): Django's wrapper translates errors of
    its own execute only."""
    if watched(conn):
        return conn.cursor()
    conn.validate_thread_sharing()
    return contextlib.closing(conn.connection.cursor())


class MySQL(mysql.MySQL, Backend):
    without_read = ("backends.at_once:apply_unread_at_once",)
    two_texts = "backends.mysql:MySQLTexts"
    locks_orders_first = True
    at_once = True

    def ready_at_once(self, conn: Any) -> bool:
        return self.several_statements(conn)

    def send_at_once(
        self, conn: Any, statements: Statements, read: list[Any]
    ) -> tuple[bool, int | None]:
        texts = ["START TRANSACTION"]
        args: list[Any] = []
        steps = ["begin"]
        for step, sql, values in statements:
            texts.append(sql)
            args.extend(values)
            steps.append(step)
            if step == "update":
                texts.append(_GUARD)
                steps.append("guard")
        texts.append("COMMIT")
        steps.append("commit")
        queued_id: int | None = None
        at = 0
        conn.ensure_connection()
        with _cursor(conn) as cursor:
            try:
                with conn.wrap_database_errors:
                    cursor.execute("; ".join(texts), args)
                    while True:
                        if steps[at] == "queue":
                            # One row inserted, and its id (0 rows: the message id was in
                            # the outbox already).
                            queued_id = cursor.lastrowid if cursor.rowcount == 1 else None
                        elif steps[at] in ("source", "read"):
                            read.append(cursor.fetchone())
                        if not cursor.nextset():
                            break
                        at += 1
            except BaseException as exc:
                # A statement failed: the ones after it (COMMIT among them) did not run.
                with contextlib.suppress(Exception):
                    cursor.execute("ROLLBACK")
                code = exc.args[0] if isinstance(exc, DatabaseError) and exc.args else None
                step = steps[at + 1] if at + 1 < len(steps) else ""
                if (code, step) in _DECLINING:
                    return False, None
                raise  # a lost connection among them: the caller reads back what committed
        return True, queued_id


def _kept(on: bool) -> None:
    """The session's autocommit, left as it is (``START TRANSACTION`` opens the transaction)."""


def _committed() -> None:
    """Django's ``COMMIT`` after a second text that committed: nothing to send."""


@dataclass(frozen=True)
class _Update:
    """The second text of one shape of transition (``%s`` arguments)."""

    sql: str
    queued: tuple[Field[Any, Any], ...]
    queued_defaults: tuple[Any, ...]
    closes: bool


class MySQLTexts(Texts):
    """mysqlclient with multi statements on (unless ``OPTIONS`` turned them off)."""

    @contextlib.contextmanager
    def transaction(self, conn: Any) -> Iterator[Block]:
        raw = conn.connection
        if not conn.in_atomic_block:
            raw.autocommit = _kept
        try:
            with atomic_block(conn) as block, _cursor(conn) as cursor:
                block.cursor = cursor
                if not block.nested:
                    block.opening, block.closing = ("START TRANSACTION",), ("COMMIT",)
                yield block
        finally:
            raw.__dict__.pop("autocommit", None)
            raw.__dict__.pop("commit", None)

    def claim_and_read(self, conn: Any, block: Block, first: FirstText) -> Sequence[Any]:
        texts = inserts()
        statements = [*block.opening, f"{first.read} FOR UPDATE", texts.inbox]
        args = [*first.read_args, *inbox_template().params(first.inbox, timezone.now())]
        if first.spent is not None:
            statements.append(texts.spent)
            args += first.spent
        cursor = block.cursor
        block.opened = True
        try:
            with conn.wrap_database_errors:
                cursor.execute("; ".join(statements), args)
                for _ in block.opening:
                    cursor.nextset()
                row = cursor.fetchone()
                while cursor.nextset():
                    pass
        except BaseException as exc:
            # Refused before it was sent (an argument the driver cannot escape, say): no
            # savepoint to roll back to. A server's error (a MySQL error number) ran the
            # opening, the first statement; a lost connection took it along.
            code = exc.args[0] if isinstance(exc, DatabaseError) and exc.args else None
            block.opened = isinstance(code, int)
            if isinstance(exc, (IntegrityError, DataError)):
                # A duplicate, a spent payment, an unknown order, a value a column refuses:
                # the statements after it did not run; the usual road says why.
                raise Declined from None
            raise
        if row is None:
            raise Declined
        return row

    def compile(self, conn: Any, update: str, queued: bool, closes: bool) -> _Update:
        statements = [update, _GUARD]
        texts = inserts()
        if queued:
            statements.append(texts.queue)
        return _Update("; ".join(statements), texts.queued, texts.queued_defaults, closes)

    def write(
        self, conn: Any, block: Block, update: Any, args: list[Any], queued: dict[str, Any] | None
    ) -> int | None:
        args = list(args)
        if queued is not None:
            args += [f.get_db_prep_save(queued[f.name], conn) for f in update.queued]
            args += update.queued_defaults
        sql = "; ".join([update.sql, *(block.closing if update.closes else ())])
        queued_id: int | None = None
        cursor = block.cursor
        try:
            with conn.wrap_database_errors:
                cursor.execute(sql, args)  # the UPDATE's result
                cursor.nextset()  # the guard's
                if queued is not None:
                    cursor.nextset()
                    # The INSERT IGNORE's own result: one row inserted, and its id (0 rows:
                    # the message id was in the outbox already).
                    queued_id = cursor.lastrowid if cursor.rowcount == 1 else None
                while cursor.nextset():
                    pass
        except DatabaseError as exc:
            if exc.args and exc.args[0] == _GUARD_FAILED:
                raise Declined from None  # the order moved: rolled back, the usual road runs
            raise
        if update.closes:
            _closed(conn, block)
        return queued_id

    def queue(
        self,
        conn: Any,
        block: Block,
        queued: dict[str, Any],
        held: tuple[str, list[Any]] | None = None,
    ) -> int | None:
        texts = inserts()
        args = [f.get_db_prep_save(queued[f.name], conn) for f in texts.queued]
        args += texts.queued_defaults
        statements = [texts.queue, *block.closing]
        if held is not None:
            # save()'s UPDATE first, and the guard that stops the text when it matched no row.
            statements[:0] = [held[0], _GUARD]
            args[:0] = held[1]
        cursor = block.cursor
        try:
            with conn.wrap_database_errors:
                cursor.execute("; ".join(statements), args)
                if held is not None:
                    cursor.nextset()  # the guard's
                    cursor.nextset()  # the INSERT IGNORE's
                # One row inserted, and its id (0 rows: the message id was queued already).
                queued_id = cursor.lastrowid if cursor.rowcount == 1 else None
                while cursor.nextset():
                    pass
        except DatabaseError as exc:
            if held is not None and exc.args and exc.args[0] == _GUARD_FAILED:
                raise Declined from None  # the order moved: rolled back, the usual road runs
            raise
        _closed(conn, block)
        return queued_id

    holds_save_update = True

    def held_prefix(self, conn: Any, update: str, params: list[Any], stop: bool = False) -> str:
        # mysqlclient reads each result at the step to it: the rows are counted
        # (:meth:`held_rows`) before a later statement's error is raised, so no stop.
        raw = conn.connection.cursor()
        try:
            text = raw.mogrify(update, params)
        finally:
            raw.close()
        return text.decode() if isinstance(text, bytes) else str(text)

    def held_unanswered(self, exc: BaseException) -> bool:
        # execute() raises only the text's first statement's error: a held UPDATE's.
        return True

    def held_rows(self, conn: Any, cursor: Any, matched: Callable[[int], None]) -> None:
        # The UPDATE's result first (Django's connection counts found rows, not changed
        # ones): mysqlclient raises the project's statement's error at nextset(), and
        # InnoDB undoes only that statement, so the count must be taken before.
        matched(int(cursor.rowcount))
        with conn.wrap_database_errors:
            vendor(conn).skip_results(cursor, 1)


def _closed(conn: Any, block: Block) -> None:
    """A text that ended the block ran whole: Django's end of it has nothing to send."""
    block.closed = True
    if not block.nested:
        conn.connection.commit = _committed
