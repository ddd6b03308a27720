"""PostgreSQL's two texts of the road
(:func:`~idempotent_orders.consuming.writing.apply`).

1. ``BEGIN; <claim the message and spend its payment>; <read the order>``: the claim
   is one statement (``INSERT ... ON CONFLICT DO NOTHING`` with the spent payment in a
   data-modifying ``WITH``) that returns ``(claimed, spent)``;
2. ``WITH moved AS (UPDATE <order> ... WHERE pk AND state AND version AND ...),
   queued AS (INSERT <outbox> <the follow-up's row> ...) SELECT 1 / count(moved), ...;
   COMMIT``: an order that moved since the read makes the division fail on purpose,
   so ``COMMIT`` never runs, the transaction rolls back and the usual road decides
   again. On the save() road, the model's ``save()`` having written the order: ``[WITH
   moved AS (<save()'s UPDATE, held for this text>) SELECT 1 / count(moved);] WITH
   queued AS (INSERT <outbox> ...) SELECT id; COMMIT``
   (:mod:`~idempotent_orders.consuming.held`).

Inside a caller's transaction the block is Django's savepoint
(:func:`~idempotent_orders.consuming.backends.atomic_block`): ``SAVEPOINT`` opens the first
text (after ``BEGIN`` when the caller's transaction has sent nothing yet) and ``RELEASE
SAVEPOINT`` ends the last instead of ``COMMIT``; a text that fails leaves Django's
rollback to the savepoint.

Each statement of the two texts runs as a prepared statement of the session, its
arguments as literals of an ``EXECUTE`` (``PREPARE`` goes in the text that first needs
it, so no round trip is added): the server neither parses nor plans them again. A
session that lost them (``DISCARD ALL``, a transaction pooler's other server) fails the
text, which rolls back like a declined message; the next message prepares them again,
up to a few misses per connection, then sends them as they are
(:func:`~idempotent_orders.prepared.execute_text`). The texts go to the
driver's own cursor unless something must see them (see
:func:`~idempotent_orders.prepared.driver_cursor`); then they go through
Django's cursor as they are.

``BEGIN`` goes in the first text because the driver's own autocommit is switched on
inside Django's ``atomic`` block (where Django switched it off, and the driver would
send ``BEGIN`` by itself, one more round trip); Django's ``commit()`` and
``rollback()`` at the end of the outermost block send ``COMMIT``/``ROLLBACK`` only for a
transaction still open, then switch autocommit on anyway. Not where ``OPTIONS`` set
an isolation level or read-only mode: the driver's own ``BEGIN`` says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.db import (
    DataError,
    IntegrityError,
    NotSupportedError,
    ProgrammingError,
)
from django.db.models import Field
from django.utils import timezone

from idempotent_orders.consuming.backends import Block, Declined, FirstText, Texts, atomic_block
from idempotent_orders.consuming.backends.postgresql import (
    Statement,
    claim_and_spend_sql,
    named,
    send_first,
    send_text,
)
from idempotent_orders.consuming.sql import (
    FOLLOW_UP_FIELDS,
    inbox_partitioned,
    inbox_template,
    queue_follow_up,
)
from idempotent_orders.prepared import driver_cursor, missed

__all__ = ["PostgreSQLTexts"]

#: SQLSTATE of the division by zero that stops the second text when the order moved.
_MOVED = "22012"


def _tail(block: Block) -> str:
    return "".join(f"; {sql}" for sql in block.closing)


@dataclass(frozen=True)
class _Claim:
    """The first text's claim: an applied message's inbox row (its columns that no message
    changes written as literals) and, for money, the spent payment."""

    sql: str
    #: The inbox columns it takes as arguments, in order (then the spent payment's four).
    names: tuple[str, ...]
    updated_at: Field[Any, Any]


#: The inbox columns a message fills in (the others are an applied row's constants).
_PER_MESSAGE = ("consumer", "message_id", "message_type", "order_id", "seq", "fingerprint")
_claims: dict[tuple[Any, ...], _Claim] = {}


def _claim(conn: Any, money: bool) -> _Claim:
    key = (conn.alias, inbox_partitioned(conn), money)
    claim = _claims.get(key)
    if claim is None:
        template = inbox_template()  # its sample row is an applied message's
        names: list[str] = []
        values: list[str] = []
        for field, value in zip(template.fields, template.base, strict=True):
            if field.attname in (*_PER_MESSAGE, "updated_at"):
                names.append(field.attname)
                values.append("%s")
            else:
                literal = str(conn.ops.compose_sql("%s", [value]))
                values.append(literal.replace("%", "%%"))
        inbox = template.insert(values)
        sql = claim_and_spend_sql(inbox) if money else f"{inbox} RETURNING 1, 1"
        updated_at = template.fields[template.positions["updated_at"]]
        claim = _claims[key] = _Claim(sql, tuple(names), updated_at)
    return claim


@dataclass(frozen=True)
class _Update:
    """The second text of one shape of transition: its SQL and the outbox fields of the
    follow-up's row, in the order the text takes them."""

    sql: str
    queued: tuple[Field[Any, Any], ...]
    closes: bool


class PostgreSQLTexts(Texts):
    """psycopg 3 with client-side binding cursors (Django's default)."""

    @contextmanager
    def transaction(self, conn: Any) -> Iterator[Block]:
        # The driver's own cursor inside the ``atomic`` block (Django's cursor wrapper
        # skipped, its error mapping kept by send_text), or Django's where something must see
        # the texts: there they go as they are, not as ``EXECUTE`` of a prepared statement.
        with atomic_block(conn) as block:
            if not block.nested:
                block.closing = ("COMMIT",)
            cursor = driver_cursor(conn, in_transaction=True)
            with conn.cursor() if cursor is None else cursor as opened:
                block.cursor = opened
                yield block

    def claim_and_read(self, conn: Any, block: Block, first: FirstText) -> Sequence[Any]:
        claim = _claim(conn, first.spent is not None)
        now = claim.updated_at.get_db_prep_save(timezone.now(), conn)
        per_message = {**first.inbox, "updated_at": now}
        args = [per_message[name] for name in claim.names]
        args += first.spent or []
        statements = [
            (claim.sql, named(claim.sql), args),
            (first.read, named(first.read), first.read_args),
        ]
        cursor = block.cursor
        try:
            send_first(conn, block, statements)
            claimed = cursor.fetchone()
            cursor.nextset()
            row = cursor.fetchone()
        except (IntegrityError, DataError):
            # Our own statements only (a value a column refuses, say): the usual road says why.
            raise Declined from None
        except (ProgrammingError, NotSupportedError) as exc:
            if missed(conn, exc):
                raise Declined from None
            raise
        if claimed is None or not claimed[0] or not claimed[1] or row is None:
            raise Declined
        return row

    def compile(self, conn: Any, update: str, queued: bool, closes: bool) -> _Update:
        sql = f"WITH moved AS ({update} RETURNING 1)"
        outbox: list[Field[Any, Any]] = []
        if queued:

            def ref(source: str, field: Field[Any, Any]) -> str:
                outbox.append(field)
                return "%s"

            sql += ", " + queue_follow_up(conn, FOLLOW_UP_FIELDS, ref)
            sql += " SELECT 1 / (SELECT count(*) FROM moved), (SELECT id FROM queued)"
        else:
            sql += " SELECT 1 / (SELECT count(*) FROM moved)"
        return _Update(sql, tuple(outbox), closes)

    def write(
        self, conn: Any, block: Block, update: Any, args: list[Any], queued: dict[str, Any] | None
    ) -> int | None:
        sql, cursor = update.sql, block.cursor
        args = list(args)
        if queued is not None:
            args += [f.get_db_prep_save(queued[f.name], conn) for f in update.queued]
        tail = _tail(block) if update.closes else ""
        try:
            for _ in range(send_text(conn, cursor, "", [(sql, named(sql), args)], tail)):
                cursor.nextset()
            row = cursor.fetchone()
        except DataError as exc:
            if getattr(exc.__cause__, "sqlstate", None) == _MOVED:
                raise Declined from None
            raise
        except (ProgrammingError, NotSupportedError) as exc:
            if missed(conn, exc):
                raise Declined from None  # rolled back whole: the usual road runs it again
            raise
        block.closed = update.closes
        return row[1] if queued is not None else None

    holds_save_update = True

    def held_prefix(self, conn: Any, update: str, params: list[Any], stop: bool = False) -> str:
        if stop:  # psycopg raises a text's first error at execute(), before any row is read
            counted = _stopping(update)
        else:
            counted = f"WITH moved AS ({update} RETURNING 1) SELECT count(*) FROM moved"
        return str(conn.ops.compose_sql(counted, params))

    def held_unanswered(self, exc: BaseException) -> bool:
        # The server ran the text up to its first error: one that is not a stopped UPDATE's
        # came after every held UPDATE before it had matched.
        return getattr(exc.__cause__, "sqlstate", None) == _MOVED

    def held_rows(self, conn: Any, cursor: Any, matched: Callable[[int], None]) -> None:
        # psycopg read every result at execute(): an error of the project's statement was
        # raised there (and aborted the transaction, so nothing of it commits).
        with conn.wrap_database_errors:
            row = cursor.fetchone()
            matched(int(row[0]) if row else 0)
            cursor.nextset()

    def queue(
        self,
        conn: Any,
        block: Block,
        queued: dict[str, Any],
        held: tuple[str, list[Any]] | None = None,
    ) -> int | None:
        sql, fields = _queue_text(conn)
        args = [f.get_db_prep_save(queued[f.name], conn) for f in fields]
        statements: list[Statement] = [(sql, named(sql), args)]
        if held is not None:
            # save()'s UPDATE first: no row matched stops the text before COMMIT.
            guard = _stopping(held[0])
            statements.insert(0, (guard, named(guard), held[1]))
        cursor = block.cursor
        try:
            skipped = send_text(conn, cursor, "", statements, _tail(block))
            for _ in range(skipped + len(statements) - 1):
                cursor.nextset()
            row = cursor.fetchone()
        except DataError as exc:
            if getattr(exc.__cause__, "sqlstate", None) == _MOVED:
                raise Declined from None
            raise
        except (ProgrammingError, NotSupportedError) as exc:
            if missed(conn, exc):
                raise Declined from None  # rolled back whole: the usual road runs it again
            raise
        block.closed = True
        return None if row is None else row[0]


def _stopping(update: str) -> str:
    """``update`` as a statement that fails (division by zero) when it matched no row."""
    return f"WITH moved AS ({update} RETURNING 1) SELECT 1 / (SELECT count(*) FROM moved)"


_queue_texts: dict[str, tuple[str, tuple[Field[Any, Any], ...]]] = {}


def _queue_text(conn: Any) -> tuple[str, tuple[Field[Any, Any], ...]]:
    """:meth:`PostgreSQLTexts.queue`'s statement (one row: the new row's id, or NULL) and
    the outbox fields it takes, in order."""
    found = _queue_texts.get(conn.alias)
    if found is None:
        outbox: list[Field[Any, Any]] = []

        def ref(source: str, field: Field[Any, Any]) -> str:
            outbox.append(field)
            return "%s"

        queue = queue_follow_up(conn, FOLLOW_UP_FIELDS, ref, after_moved=False)
        found = _queue_texts[conn.alias] = (
            f"WITH {queue} SELECT (SELECT id FROM queued)",
            tuple(outbox),
        )
    return found
