"""MariaDB's and SQLite's road without a read: a message's writes as one transaction of
their own, with the decision's tests in the UPDATE.

Where :func:`~idempotent_orders.consuming.unread.plan` finds nothing of the project's to
run (a follow-up only as the outbox row it hands over, see
:class:`~idempotent_orders.consuming.running.FollowUpRow`), what the transaction writes
is known before it starts: the inbox row, the spent payment, the order's UPDATE with the
tests :func:`~idempotent_orders.consuming.decision.decide` makes for an "apply" in its
WHERE clause, and the follow-up's outbox row. A transition of several sources tests the
state against each; where a receiver hears it, the state the order leaves is read in the
same transaction, before the UPDATE (``SELECT ... FOR UPDATE`` on MariaDB; SQLite's
transaction holds the write lock). :func:`apply_unread_at_once` sends them together:

- MariaDB/MySQL: one multi-statement text (mysqlclient enables multi statements
  unless ``OPTIONS`` turns them off), ``START TRANSACTION; INSERT inbox; INSERT spent;
  UPDATE order; <guard>; INSERT IGNORE outbox; COMMIT``. The server stops at the first
  statement that fails, so a duplicate (the inbox's unique index), a spent payment (its
  unique index) or an order the tests refuse (the guard fails when the UPDATE matched no
  row) never reaches ``COMMIT``; the transaction is rolled back and
  :mod:`~idempotent_orders.consuming.writing` reads, decides and says why.
- SQLite: the same statements one after another on the driver's cursor between
  ``BEGIN`` (with the database's own ``transaction_mode``) and ``COMMIT``.

Taken only outside a caller's transaction (``START TRANSACTION`` would commit it), so
the after-commit work (the publish of the outbox row, the fast-path mark) runs once
this returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    DataError,
    IntegrityError,
    OperationalError,
    connection,
    connections,
)
from django.db.models import DecimalField, Field, Model
from django.utils import timezone

from idempotent_orders.consuming.backends import backend
from idempotent_orders.consuming.envelope import Envelope
from idempotent_orders.consuming.failures import is_retryable
from idempotent_orders.consuming.graph import state_field
from idempotent_orders.consuming.payments import spent_table
from idempotent_orders.consuming.rules import Test
from idempotent_orders.consuming.running import written_values
from idempotent_orders.consuming.sql import FOLLOW_UP_FIELDS, inbox_template
from idempotent_orders.consuming.unread import field_of, plan, update_sql, written
from idempotent_orders.models import OutboxMessage, Outcome
from idempotent_orders.signals import order_transitioned

__all__ = ["apply_unread_at_once", "can_apply_unread_at_once"]

#: MySQL's error numbers for a duplicate key, and for the guard's scalar subquery
#: returning two rows.
_DUPLICATE_KEY = 1062
_GUARD_FAILED = 1242
#: mysqlclient's ``CLIENT.MULTI_STATEMENTS``.
_MULTI_STATEMENTS = 1 << 16


#: What a transaction sent at once did: ``(applied, queued id)``. Not applied: a duplicate,
#: a payment spent already or an order the tests refuse (rolled back, nothing written).
#: The queued id is the follow-up's outbox row; None when its message id was there already.
_Sent = tuple[bool, int | None]
_DECLINED: _Sent = (False, None)


def can_apply_unread_at_once() -> bool:
    """Whether :func:`apply_unread_at_once` may run now: SQLite, or MariaDB/MySQL with
    multi statements on, outside any transaction (in autocommit: with ``AUTOCOMMIT``
    off a transaction may be open, and ``START TRANSACTION`` would commit it)."""
    conn = connections[DEFAULT_DB_ALIAS]
    if conn.in_atomic_block or not conn.get_autocommit():
        return False
    chosen = backend(conn)
    if not chosen.at_once_in_one_text:
        return chosen.at_once
    conn.ensure_connection()
    return bool(getattr(conn.connection, "client_flag", 0) & _MULTI_STATEMENTS)


@dataclass(frozen=True)
class _Texts:
    """The statements around the UPDATE, with ``%s`` placeholders (the same for every
    message of a database)."""

    inbox: str
    spent: str
    queue: str
    #: The outbox columns filled per message (the others are the model's defaults).
    queued: tuple[Field[Any, Any], ...]
    queued_defaults: tuple[Any, ...]


_texts: dict[str, _Texts] = {}


def _compile() -> _Texts:
    qn = connection.ops.quote_name
    template = inbox_template()
    inbox = template.head + ", ".join(["%s"] * len(template.fields)) + ")"
    spent_name, spent_columns = spent_table()
    spent = f"INSERT INTO {spent_name} ({', '.join(spent_columns)}) VALUES (%s, %s, %s, %s)"
    ometa = OutboxMessage._meta
    sample = OutboxMessage()
    written = [f for f in ometa.concrete_fields if not f.primary_key and not f.has_db_default()]
    queued = tuple(f for f in written if f.name in FOLLOW_UP_FIELDS)
    defaults = tuple(
        f.get_db_prep_save(f.pre_save(sample, True), connection)
        for f in written
        if f.name not in FOLLOW_UP_FIELDS
    )
    columns = ", ".join(
        qn(str(f.column))
        for f in (*queued, *(f for f in written if f.name not in FOLLOW_UP_FIELDS))
    )
    # The lengths were checked (``handed_over``): a repeated message id is all a skipped
    # row can be, and then the row that holds it is the message.
    unique = qn(str(ometa.get_field("message_id").column))
    head, tail = backend().insert_ignoring(qn(ometa.db_table), columns, unique)
    queue = f"{head} VALUES ({', '.join(['%s'] * len(written))}) {tail}".rstrip()
    return _Texts(inbox, spent, queue, queued, defaults)


#: Fails (more than one row in a scalar subquery) unless the UPDATE before it matched
#: one row: the statements after it, ``COMMIT`` included, never run.
_GUARD = (
    "SELECT (SELECT 1 FROM (SELECT 1 AS one UNION ALL SELECT 2) AS io_guard"
    " WHERE ROW_COUNT() <> 1 AND one > 0)"
)


def _sqlite(statements: Sequence[tuple[str, str, Sequence[Any]]], read: list[Any]) -> _Sent:
    conn = connections[DEFAULT_DB_ALIAS]
    mode = getattr(conn, "transaction_mode", None)
    queued_id: int | None = None
    conn.ensure_connection()
    # Straight to the driver unless something must see the queries (query logging, an
    # execute wrapper): Django's cursor wrapper costs more than a statement here.
    watched = conn.queries_logged or conn.execute_wrappers
    if not watched:
        conn.validate_thread_sharing()
    with (
        conn.cursor() if watched else contextlib.closing(conn.connection.cursor()) as cursor,
        conn.wrap_database_errors,
    ):
        cursor.execute(f"BEGIN {mode}" if mode else "BEGIN")
        refused = (IntegrityError, conn.Database.IntegrityError)  # type: ignore[attr-defined]
        try:
            for step, sql, args in statements:
                try:
                    cursor.execute(sql if watched else _qmark(sql), args)
                except refused:
                    if step not in ("inbox", "spent"):
                        raise
                    cursor.execute("ROLLBACK")
                    return _DECLINED
                if step == "update" and cursor.rowcount != 1:
                    cursor.execute("ROLLBACK")
                    return _DECLINED
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


#: The failures of a step that mean "declined": ``(MySQL error number, step)``.
_DECLINING = {(_DUPLICATE_KEY, "inbox"), (_DUPLICATE_KEY, "spent"), (_GUARD_FAILED, "guard")}


def _mysql(statements: Sequence[tuple[str, str, Sequence[Any]]], read: list[Any]) -> _Sent:
    conn = connections[DEFAULT_DB_ALIAS]
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
    # The driver's cursor unless something must see the query, as on SQLite (Django's
    # wrapper translates errors of its execute only: START TRANSACTION's, none of ours).
    conn.ensure_connection()
    watched = conn.queries_logged or conn.execute_wrappers
    if not watched:
        conn.validate_thread_sharing()
    with conn.cursor() if watched else contextlib.closing(conn.connection.cursor()) as cursor:
        try:
            with conn.wrap_database_errors:
                cursor.execute("; ".join(texts), args)
                while True:
                    if steps[at] == "queue":
                        # One row inserted, and its id (0 rows: the message id was in
                        # the outbox already), as on SQLite.
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
                return _DECLINED
            raise  # a lost connection among them: the caller reads back what committed
    return True, queued_id


def _test_value(field: Field[Any, Any], value: Any, exact_digits: int | None) -> Any:
    """``value`` as the test sends it; None when the test could not be exact.

    A decimal goes as a literal of the column's own scale: one that the column cannot
    hold exactly (more digits) never equals it, and the usual road says why; a literal
    of more digits than the server keeps would be compared as a float. SQLite keeps a
    decimal column as a double: a column of more than 15 digits is not tested there.
    """
    if not isinstance(field, DecimalField):
        return value
    if exact_digits is not None and (field.max_digits or 99) > exact_digits:
        return None
    try:
        exact = value.quantize(Decimal(1).scaleb(-(field.decimal_places or 0)))
    except InvalidOperation:  # more digits than a decimal context keeps: never the column's
        return None
    if exact != value or len(exact.as_tuple().digits) > (field.max_digits or 65):
        return None
    return exact


def apply_unread_at_once(envelope: Envelope, consumer: str, model: type[Model]) -> Outcome | None:
    """Apply ``envelope`` as one transaction of its own, the order untested by a read;
    None: nothing written, read first.

    InnoDB checks the WHERE clause on the row version it locks, and SQLite's transaction
    holds the database's write lock, so the tests hold on the order the UPDATE writes.
    Anything the tests, the unique indexes or a column refuse rolls all of it back. On
    APPLIED the inbox row, the transition and its follow-up's outbox row are committed;
    the caller announces the outcome.
    """
    if not can_apply_unread_at_once():
        return None
    # Several sources: the state tested against each; the one left read in the same text.
    p = plan(envelope, model, several=True)
    if p is None or p.follow_ups is None:
        return None  # read first; or a follow-up writes its own rows: the usual road
    conn = connections[DEFAULT_DB_ALIAS]
    chosen = backend(conn)
    shape, fields, tests, handed = p.shape, p.fields, p.tests, p.handed
    seq = envelope.seq
    values = written_values(model, {**fields, "last_seq": seq} if seq is not None else fields)
    sources = len(shape.sources)
    tested = tuple((t[0], t[2]) for t in tests)
    key = (conn.alias, model, tuple(values), tested, seq is None, sources)
    update = _updates.get(key)
    if update is None:
        update = _updates[key] = _update(conn, model, list(values), tests, seq is not None, sources)
    args: list[Any] = [shape.target]
    args += [
        f.get_db_prep_save(v, conn) for f, v in zip(update.values, values.values(), strict=True)
    ]
    assert model._meta.pk is not None
    order_id = model._meta.pk.get_db_prep_value(envelope.order_id, conn)
    args += [order_id, *shape.sources]
    if seq is not None:
        args.append(seq - 1)
    for field, (_, value, _) in zip(update.tests, tests, strict=True):
        sent = _test_value(field, value, chosen.exact_decimal_digits)
        if sent is None:
            return None
        args.append(field.get_db_prep_save(sent, conn))
    texts = _texts_for()
    now = timezone.now()
    inbox = envelope.inbox_fields(consumer)
    statements: list[tuple[str, str, Sequence[Any]]] = [
        ("inbox", texts.inbox, inbox_template().params(inbox, now))
    ]
    payment = p.payment
    if payment is not None:
        spent = [payment, envelope.order_id, consumer, envelope.message_id]
        statements.append(("spent", texts.spent, spent))
    # No fsm-2 receiver, the follow-up handed over: read back only for order_transitioned,
    # with the state the order leaves where it may be one of several (locked till COMMIT).
    announced = order_transitioned.has_listeners(model)
    if announced and sources > 1:
        statements.append(("source", update.source, [order_id]))
    statements.append(("update", update.sql, args))
    if announced:
        statements.append(("read", p.read.sql, [order_id]))
    if handed is not None:
        queued = [f.get_db_prep_save(handed[1].fields[f.name], conn) for f in texts.queued]
        statements.append(("queue", texts.queue, [*queued, *texts.queued_defaults]))
    read: list[Any] = []
    try:
        send = _mysql if chosen.at_once_in_one_text else _sqlite
        applied, queued_id = send(statements, read)
    except (IntegrityError, DataError):
        return None  # rolled back: the usual road decides, and says why
    except OperationalError as exc:
        if not is_retryable(exc):
            raise
        # Rolled back whole (the inbox row's foreign-key lock and a concurrent UPDATE of
        # the order can cross): the usual road reads, decides and writes it again.
        return None
    if not applied:
        return None
    if handed is not None and queued_id is not None:
        handed[1].written(DEFAULT_DB_ALIAS, queued_id)
    if announced:
        if sources > 1:
            (source,), row = read
            written(model, p, row, source)
        else:
            written(model, p, read[0])
    return Outcome.APPLIED


@dataclass(frozen=True)
class _Update:
    """:func:`apply_unread_at_once`'s UPDATE of one shape of message, with ``%s`` placeholders:
    ``SET <state>, version, <values> WHERE pk, <state>, has_parked[, last_seq], <tests>``;
    the state tested against each source of the transition."""

    sql: str
    values: tuple[Field[Any, Any], ...]
    tests: tuple[Field[Any, Any], ...]
    #: The order's state read before the UPDATE, locked (``FOR UPDATE`` on MariaDB; SQLite's
    #: transaction holds the write lock): the source it leaves, where it may be several.
    source: str


_updates: dict[tuple[Any, ...], _Update] = {}


def _update(
    conn: Any, model: type[Model], values: list[str], tests: list[Test], seq: bool, sources: int
) -> _Update:
    meta = model._meta
    assert meta.pk is not None
    qn = conn.ops.quote_name
    chosen = backend(conn)
    tested = [(name, empty) for name, _, empty in tests]
    sql = update_sql(model, lambda role, field: "%s", sources, values, tested, seq, conn)
    table, pk = qn(meta.db_table), qn(str(meta.pk.column))
    lock = " FOR UPDATE" if chosen.at_once_in_one_text else ""
    source = f"SELECT {qn(str(state_field(model).column))} FROM {table} WHERE {pk} = %s{lock}"
    return _Update(
        sql,
        tuple(field_of(model, name) for name in values),
        tuple(field_of(model, name) for name, _, _ in tests),
        source,
    )


def _texts_for() -> _Texts:
    """The inbox, spent-payment and outbox statements (the UPDATE is the caller's)."""
    texts = _texts.get(DEFAULT_DB_ALIAS)
    if texts is None:
        texts = _texts[DEFAULT_DB_ALIAS] = _compile()
    return texts
