"""MariaDB's and SQLite's road without a read: a message's writes as one transaction of
their own, with the decision's tests in the UPDATE.

Where :func:`~idempotent_orders.consuming.unread.plan` finds nothing of the project's to
run (a follow-up only as the outbox row it hands over, see
:class:`~idempotent_orders.consuming.running.FollowUpRow`), what the transaction writes
is known before it starts: the inbox row, the spent payment, the order's UPDATE with the
tests :func:`~idempotent_orders.consuming.decision.decide` makes for an "apply" in its
WHERE clause, and the follow-up's outbox row. A transition of several sources tests the
state against each; where a receiver hears it, the state the order leaves is read in the
same transaction, before the UPDATE (locked where the database locks a row it reads).
:func:`apply_unread_at_once` has the backend send them together
(:meth:`~idempotent_orders.consuming.backends.Backend.send_at_once`: one multi-statement
text on MariaDB, the driver's statements between ``BEGIN`` and ``COMMIT`` on SQLite); a
duplicate, a spent payment or an order the tests refuse rolls all of it back, and
:mod:`~idempotent_orders.consuming.writing` reads, decides and says why.

Taken only outside a caller's transaction (``START TRANSACTION`` would commit it), so
the after-commit work (the publish of the outbox row, the fast-path mark) runs once
this returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import (
    DEFAULT_DB_ALIAS,
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

__all__ = ["apply_unread_at_once", "can_apply_unread_at_once", "inserts"]


def can_apply_unread_at_once() -> bool:
    """Whether :func:`apply_unread_at_once` may run now: SQLite, or MariaDB/MySQL with
    multi statements on, outside any transaction (in autocommit: with ``AUTOCOMMIT``
    off a transaction may be open, and ``START TRANSACTION`` would commit it)."""
    conn = connections[DEFAULT_DB_ALIAS]
    if conn.in_atomic_block or not conn.get_autocommit():
        return False
    return backend(conn).ready_at_once(conn)


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


def inserts() -> _Texts:
    """The inbox, spent-payment and outbox statements around the UPDATE, compiled once."""
    texts = _texts.get(DEFAULT_DB_ALIAS)
    if texts is None:
        texts = _texts[DEFAULT_DB_ALIAS] = _compile()
    return texts


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
    texts = inserts()
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
        applied, queued_id = chosen.send_at_once(conn, statements, read)
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
    tested = [(name, empty) for name, _, empty in tests]
    sql = update_sql(model, lambda role, field: "%s", sources, values, tested, seq, conn)
    table, pk = qn(meta.db_table), qn(str(meta.pk.column))
    lock = " FOR UPDATE" if conn.features.has_select_for_update else ""
    source = f"SELECT {qn(str(state_field(model).column))} FROM {table} WHERE {pk} = %s{lock}"
    return _Update(
        sql,
        tuple(field_of(model, name) for name in values),
        tuple(field_of(model, name) for name, _, _ in tests),
        source,
    )
