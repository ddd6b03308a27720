"""MariaDB's and MySQL's two texts of :mod:`~idempotent_orders.consuming.backends.claim_and_run`,
each one multi-statement text (mysqlclient's ``CLIENT.MULTI_STATEMENTS``, as
:mod:`~idempotent_orders.consuming.backends.at_once` sends its one):

1. ``START TRANSACTION; SELECT <order> ... FOR UPDATE; INSERT <inbox>; [INSERT
   <spent payment>]``: the order is locked before the inbox row's foreign key
   share-locks it (as a batch locks its orders first), and a duplicate or a spent
   payment fails its unique index, which stops the text;
2. ``UPDATE <order> ... WHERE pk AND state AND version AND ...; <guard>; [INSERT IGNORE
   <outbox>]; COMMIT``: the guard fails (a scalar subquery of two rows) when the UPDATE
   matched no row, so ``COMMIT`` never runs; the road rolls back and the usual road
   decides again. On the save() road, the model's ``save()`` having written the order:
   ``INSERT IGNORE <outbox>; COMMIT``.

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, DataError, IntegrityError, transaction
from django.db.models import Field, Model
from django.utils import timezone

from idempotent_orders.consuming.backends.at_once import _GUARD, _MULTI_STATEMENTS, _texts_for
from idempotent_orders.consuming.backends.claim_and_run import Conflict, Declined, Texts
from idempotent_orders.consuming.envelope import Envelope
from idempotent_orders.consuming.graph import state_field
from idempotent_orders.consuming.running import guarded_update_sql
from idempotent_orders.consuming.sql import inbox_template

__all__ = ["MySQLTexts"]

#: MySQL's error number for the guard's scalar subquery returning two rows.
_GUARD_FAILED = 1242


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
    commit: bool


class MySQLTexts(Texts):
    """mysqlclient with multi statements on (unless ``OPTIONS`` turned them off)."""

    def ready(self, conn: Any) -> bool:
        return bool(getattr(conn.connection, "client_flag", 0) & _MULTI_STATEMENTS)

    @contextlib.contextmanager
    def transaction(self, conn: Any) -> Iterator[Any]:
        raw = conn.connection
        raw.autocommit = _kept
        try:
            with transaction.atomic(using=conn.alias):
                # The driver's cursor unless something must see the texts (query logging,
                # an execute wrapper), as at_once sends its text.
                watched = conn.queries_logged or conn.execute_wrappers
                if not watched:
                    conn.validate_thread_sharing()
                with conn.cursor() if watched else contextlib.closing(raw.cursor()) as cursor:
                    yield cursor
        finally:
            raw.__dict__.pop("autocommit", None)
            raw.__dict__.pop("commit", None)

    def claim_and_read(
        self,
        conn: Any,
        cursor: Any,
        envelope: Envelope,
        consumer: str,
        payment: str | None,
        read: str,
        read_args: Sequence[Any],
    ) -> Sequence[Any]:
        texts = _texts_for()
        statements = ["START TRANSACTION", f"{read} FOR UPDATE", texts.inbox]
        args = [
            *read_args,
            *inbox_template().params(envelope.inbox_fields(consumer), timezone.now()),
        ]
        if payment is not None:
            statements.append(texts.spent)
            args += [payment, envelope.order_id, consumer, envelope.message_id]
        try:
            with conn.wrap_database_errors:
                cursor.execute("; ".join(statements), args)
                cursor.nextset()
                row = cursor.fetchone()
                while cursor.nextset():
                    pass
        except (IntegrityError, DataError):
            # A duplicate, a spent payment, an unknown order, a value a column refuses: the
            # statements after it did not run; the usual road says why.
            raise Declined from None
        if row is None:
            raise Declined
        return row

    def compile(
        self,
        conn: Any,
        model: type[Model],
        meta: Any,
        values: Sequence[Field[Any, Any]],
        conditions: Sequence[Field[Any, Any]],
        queued: bool,
        commit: bool,
    ) -> _Update:
        statements = [
            guarded_update_sql(conn, meta, str(state_field(model).column), values, conditions),
            _GUARD,
        ]
        texts = _texts_for()
        if queued:
            statements.append(texts.queue)
        if commit:
            statements.append("COMMIT")
        return _Update("; ".join(statements), texts.queued, texts.queued_defaults, commit)

    def write(
        self,
        conn: Any,
        cursor: Any,
        update: Any,
        args: Sequence[Any],
        queued: dict[str, Any] | None,
    ) -> int | None:
        args = list(args)
        if queued is not None:
            args += [f.get_db_prep_save(queued[f.name], conn) for f in update.queued]
            args += update.queued_defaults
        queued_id: int | None = None
        try:
            with conn.wrap_database_errors:
                cursor.execute(update.sql, args)  # the UPDATE's result
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
                raise Conflict from None  # the order moved: rolled back, the usual road runs
            raise
        if update.commit:
            conn.connection.commit = _committed
        return queued_id

    def queue(self, conn: Any, cursor: Any, queued: dict[str, Any]) -> int | None:
        texts = _texts_for()
        args = [f.get_db_prep_save(queued[f.name], conn) for f in texts.queued]
        with conn.wrap_database_errors:
            cursor.execute(f"{texts.queue}; COMMIT", [*args, *texts.queued_defaults])
            # One row inserted, and its id (0 rows: the message id was in the outbox already).
            queued_id = cursor.lastrowid if cursor.rowcount == 1 else None
            while cursor.nextset():
                pass
        conn.connection.commit = _committed
        return queued_id
