"""PostgreSQL's road for what its one statement cannot take: two round trips.

A transition with a body, ``conditions=`` or fsm-2 receivers cannot be decided in
SQL (:mod:`~idempotent_orders.consuming.backends.postgresql.one_statement`): the model's
own method must run on the order as read. Nor can a message whose validator is the
project's own, or whose transition has several sources, though nothing of the project's
runs (:func:`~idempotent_orders.consuming.unread.fits` says which the statement takes;
a message it took, or declined for what the order held, is never claimed here). The
usual road reads the order, then begins, claims the message, updates the order, queues
the follow-up and commits, one round trip each.
Here the same statements travel in two texts (the client-side binding cursor, Django's
default on psycopg 3, sends several statements in one ``execute``; ``nextset()``
reaches the later results):

1. ``BEGIN; <claim the message and spend its payment>; <read the order>``; then, in
   Python, :func:`~idempotent_orders.consuming.decision.decide` on the order as read
   and the model's own transition (conditions, body, fsm-2's signals and whatever
   their receivers send, in this transaction);
2. ``WITH moved AS (UPDATE <order> ... WHERE pk AND state AND version AND ...),
   queued AS (INSERT <outbox> <the follow-up's row> ...) SELECT 1 / count(moved), ...;
   COMMIT``: an order that moved since the read makes the division fail on purpose,
   so ``COMMIT`` never runs, the transaction rolls back and the usual road decides
   again.

Where the model's ``save()`` runs the project's code
(:func:`~idempotent_orders.consuming.running.save_hooks`: an override, ``pre_save``/
``post_save`` receivers, a history package, triggers), the first text is the same and
the write is the usual road's:
:func:`~idempotent_orders.consuming.writing.settle`, the model's own ``save()`` with the
version guard, whatever its receivers write, the follow-up, then Django's ``COMMIT``.
Only the read and the driver's ``BEGIN`` are saved, two round trips; the project's code
runs as on the usual road. Where the app keeps no ``has_parked`` flag (triggers watch
the order), the caller looks for parked successors after commit, as after the usual road.

The claim comes before the decision (the usual road decides first), so it is an
applied message's row; any other decision (a duplicate, a message to park or reject,
a spent payment, an order with parked messages) rolls it back, and the usual road
reads, decides, writes and says why, as ever. Where more than those writes is needed
(fsm-2's ``on_error``, a receiver that saved the order, a follow-up that does not
hand its row over, a value only the ORM can write), the second text is
the conditional UPDATE alone, or :func:`~idempotent_orders.consuming.writing.settle`,
and Django's ``atomic`` commits as usual.

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
``rollback()`` at the end of the block send ``COMMIT``/``ROLLBACK`` only for a
transaction still open, then switch autocommit on anyway. Not where ``OPTIONS`` set
an isolation level or read-only mode: the driver's own ``BEGIN`` says so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import (
    DEFAULT_DB_ALIAS,
    DataError,
    IntegrityError,
    NotSupportedError,
    OperationalError,
    ProgrammingError,
    connections,
    transaction,
)
from django.db.backends.utils import CursorWrapper
from django.db.models import Field, Model
from django.utils import timezone

from idempotent_orders.consuming.backends import backend
from idempotent_orders.consuming.decision import decide
from idempotent_orders.consuming.envelope import Envelope
from idempotent_orders.consuming.failures import is_retryable
from idempotent_orders.consuming.graph import TransitionResult, TransitionStatus, state_field
from idempotent_orders.consuming.payments import claim_and_spend_sql, payment_id
from idempotent_orders.consuming.running import (
    FollowUp,
    FollowUpRow,
    Ran,
    call_transition,
    follow_up_rows,
    guarded_update_sql,
    keeps_parked_flag,
    save_hooks,
    transition_written,
)
from idempotent_orders.consuming.sql import (
    FOLLOW_UP_FIELDS,
    build,
    compiled_read,
    handed_over,
    inbox_partitioned,
    inbox_template,
    queue_follow_up,
)
from idempotent_orders.consuming.unread import fits
from idempotent_orders.consuming.writing import Conflict, settle
from idempotent_orders.models import AbstractOrder, Outcome
from idempotent_orders.prepared import driver_cursor, execute_text, missed

__all__ = ["can_claim_and_run", "claim_and_run"]

#: SQLSTATE of the division by zero that stops the second text when the order moved.
_MOVED = "22012"
_COMMIT = "; COMMIT"
#: libpq's PQTRANS_IDLE: no transaction open on the connection.
_IDLE = 0


class _Declined(Exception):
    """Not this road's message after all: roll back, the usual road takes it."""


def can_claim_and_run(conn: Any) -> bool:
    """Whether :func:`claim_and_run` may run on ``conn`` now: PostgreSQL through psycopg 3
    with client-side binding cursors (Django's default), outside any transaction."""
    if not backend(conn).one_statement or conn.in_atomic_block or not conn.get_autocommit():
        return False
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3:
        return False
    import psycopg

    conn.ensure_connection()
    return issubclass(conn.connection.cursor_factory, psycopg.ClientCursor)


def claim_and_run(envelope: Envelope, consumer: str, model: type[Model]) -> Outcome | None:
    """Apply ``envelope`` in two round trips when one_statement cannot take its kind
    (:func:`~idempotent_orders.consuming.unread.fits`); None: nothing was written, take
    the usual road.

    On APPLIED (or REJECTED: the body raised under fsm-2's ``on_error``, as the usual
    road keeps it) the message is committed and announced inside the transaction as the
    usual road announces it; the caller announces the outcome. An exception from the
    project's code propagates after the rollback, as on the usual road.
    """
    name = envelope.handler.transition
    if fits(envelope, model):
        # one_statement's kind: it took the message, or declined it for a reason the
        # order gave (its state, a duplicate, parked messages, a rule's test): read it.
        return None
    alias, plan = compiled_read(model, "pk")
    if plan is None or alias != DEFAULT_DB_ALIAS:
        return None
    conn = connections[alias]
    if not can_claim_and_run(conn):
        return None
    payment = payment_id(envelope)
    try:
        # One cursor for both texts (the project's code in between may use its own).
        with transaction.atomic(using=alias), _cursor(conn) as cursor:
            order = _claim_and_read(envelope, consumer, model, conn, cursor, plan, payment)
            verdict = decide(order, envelope)
            if verdict.outcome is not Outcome.APPLIED:
                raise _Declined
            # The usual road's conditions (writing.write): the flag as read, where the app
            # keeps it (elsewhere the caller looks for parked successors after commit).
            conditions: dict[str, Any] = {"has_parked": False} if keeps_parked_flag(model) else {}
            if envelope.seq is not None:
                conditions["last_seq"] = envelope.seq - 1
            version: int = order.version
            ran = call_transition(order, name, verdict.kwargs, fields=verdict.values)
            # Where the project's code runs on save(), the model's own save() commits it
            # (running.commit), as on the usual road; the rest of the road is the same.
            if save_hooks(model) or not _finish(order, ran, version, conditions, conn, cursor):
                return settle(envelope, consumer, order, ran, version, conditions)
            return Outcome.APPLIED
    except (_Declined, Conflict):
        return None
    except OperationalError as exc:
        if not is_retryable(exc):
            raise
        return None  # rolled back whole (a deadlock, say): the usual road runs it again


def _cursor(conn: Any) -> Any:
    """The driver's own cursor inside the ``atomic`` block (Django's cursor wrapper skipped,
    its error mapping kept by :func:`_send`), or Django's where something must see the
    texts (see :func:`~idempotent_orders.prepared.driver_cursor`): there they
    go as they are, not as ``EXECUTE`` of a prepared statement."""
    cursor = driver_cursor(conn, in_transaction=True)
    return conn.cursor() if cursor is None else cursor


#: A statement of a text: as it is (``%s`` arguments), its arguments named (``%(a0)s``).
_Statement = tuple[str, str, Sequence[Any]]
_named_forms: dict[str, str] = {}


def _named(sql: str) -> str:
    """``sql`` with its ``%s`` arguments named by position, as prepared statements take them."""
    named = _named_forms.get(sql)
    if named is None:
        count = iter(range(sql.count("%s")))
        named = _named_forms[sql] = re.sub(
            r"%s|%%", lambda m: m[0] if m[0] == "%%" else f"%(a{next(count)})s", sql
        )
    return named


def _send(conn: Any, cursor: Any, head: str, statements: Sequence[_Statement], tail: str) -> int:
    """Send ``head``, ``statements`` and ``tail`` as one text; the number of results
    before the first statement's (its ``PREPARE``s).

    On the driver's own cursor each statement runs as a prepared statement of the
    session (prepared in this same text the first time): the server neither parses nor
    plans it again. A session that lost one (a pooler's other server, ``DISCARD ALL``)
    fails the text; the caller rolls back and takes the usual road, and the next message
    prepares it again, up to a few misses per connection (then they go as they are)."""
    composed: list[tuple[str | None, str]] = []
    if not isinstance(cursor, CursorWrapper):  # Django's: something must see the SQL
        for _, named, args in statements:
            one = execute_text(conn, named, args)
            if one is None:
                composed = []
                break
            composed.append(one)
    with conn.wrap_database_errors:
        if composed:
            prepares = [prepare for prepare, _ in composed if prepare is not None]
            executes = [execute for _, execute in composed]
            cursor.execute(head + "; ".join([*prepares, *executes]) + tail)
            return len(prepares)
        text = head + "; ".join(sql for sql, _, _ in statements) + tail
        cursor.execute(text, [arg for _, _, args in statements for arg in args])
        return 0


def _opening(conn: Any) -> str:
    """``"BEGIN; "`` when the first text may open the transaction itself (the driver's
    autocommit switched on for it), else ``""`` (the driver sends its own ``BEGIN``)."""
    raw = conn.connection
    if raw.isolation_level is not None or raw.read_only is not None or raw.deferrable:
        return ""
    if raw.pgconn.transaction_status != _IDLE:
        return ""  # begun already (the inbox's shape was looked up on this connection)
    raw.autocommit = True  # idle: no round trip; Django's atomic switches it back on exit
    return "BEGIN; "


def _claim_and_read(
    envelope: Envelope,
    consumer: str,
    model: type[Model],
    conn: Any,
    cursor: Any,
    plan: Any,
    payment: str | None,
) -> AbstractOrder:
    """The first text: claim the message as applied (and spend its payment), read the
    order. Raises _Declined for a duplicate, a spent payment, an unknown order, or an
    order with parked messages (the usual road answers those)."""
    claim = _claim(conn, payment is not None)
    now = timezone.now()
    per_message = {
        **envelope.inbox_fields(consumer),
        "updated_at": claim.updated_at.get_db_prep_save(now, conn),
    }
    args = [per_message[name] for name in claim.names]
    if payment is not None:
        args += [payment, envelope.order_id, consumer, envelope.message_id]
    pk = model._meta.pk
    assert pk is not None
    statements = [
        (claim.sql, _named(claim.sql), args),
        (plan.sql, _named(plan.sql), [pk.get_db_prep_value(envelope.order_id, conn)]),
    ]
    opening = _opening(conn)
    try:
        skipped = _send(conn, cursor, opening, statements, "")
        for _ in range(skipped + bool(opening)):
            cursor.nextset()
        claimed = cursor.fetchone()
        cursor.nextset()
        row = cursor.fetchone()
    except (IntegrityError, DataError):
        # Our own statements only (a value a column refuses, say): the usual road says why.
        raise _Declined from None
    except (ProgrammingError, NotSupportedError) as exc:
        if missed(conn, exc):
            raise _Declined from None
        raise
    if claimed is None or not claimed[0] or not claimed[1] or row is None:
        raise _Declined
    order = build(model, conn.alias, plan, row)
    if order.has_parked:  # type: ignore[attr-defined]
        raise _Declined  # released after the write by the usual road
    return order  # type: ignore[return-value]


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
    """The second text of one shape of transition: its SQL and the fields of its arguments."""

    sql: str
    values: tuple[Field[Any, Any], ...]
    conditions: tuple[Field[Any, Any], ...]
    #: The outbox fields of the follow-up's row, in the order the text takes them.
    queued: tuple[Field[Any, Any], ...]


_updates: dict[tuple[Any, ...], _Update | None] = {}


def _compile(
    conn: Any,
    model: type[Model],
    values: Sequence[str],
    conditions: Sequence[str],
    queued: bool,
    commit: bool,
) -> _Update | None:
    """The conditional UPDATE of ``values`` (attnames) as :func:`running.commit` writes
    it, the follow-up's row when ``queued``, ``COMMIT`` when ``commit``; None when a
    column is not a plain one of the model's own table (the ORM writes it)."""
    concrete = model._meta.concrete_model
    assert concrete is not None
    meta = concrete._meta  # a proxy's table is its concrete model's
    by_attname = {f.attname: f for f in meta.concrete_fields}
    fields = [by_attname.get(name) for name in (*values, *conditions)]
    if meta.parents or any(f is None or f.model is not concrete or f.primary_key for f in fields):
        return None  # a parent's column (multi-table inheritance): the ORM writes it
    if any(hasattr(f, "get_placeholder") for f in fields):
        return None
    value_fields = [by_attname[n] for n in values]
    condition_fields = [by_attname[n] for n in conditions]
    update = guarded_update_sql(
        conn, meta, str(state_field(model).column), value_fields, condition_fields
    )
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
    if commit:
        sql += _COMMIT
    return _Update(sql, tuple(value_fields), tuple(condition_fields), tuple(outbox))


def _finish(
    order: AbstractOrder,
    ran: Ran,
    version: int,
    conditions: Mapping[str, Any],
    conn: Any,
    cursor: Any,
) -> bool:
    """The second text: write what the transition did, queue its follow-up and commit,
    then announce it (its publish and ``order_transitioned`` run after the block). False,
    with nothing sent, where :func:`~idempotent_orders.consuming.writing.settle` must."""
    if ran.error is not None or ran.saved:
        return False
    if any(hasattr(v, "resolve_expression") or isinstance(v, Model) for v in ran.values.values()):
        return False
    model = type(order)
    rows = follow_up_rows(model, order.pk, ran.name, ran.target)
    handed: tuple[FollowUp, FollowUpRow] | None = None
    if rows and len(rows) == 1 and handed_over(rows[0][1].fields):
        handed = rows[0]
    # COMMIT goes with the UPDATE unless a follow-up writes on its own after it.
    commit = rows is not None and (not rows or handed is not None)
    key = (conn.alias, model, tuple(ran.values), tuple(conditions), handed is not None, commit)
    try:
        update = _updates[key]
    except KeyError:
        update = _updates[key] = _compile(
            conn, model, list(ran.values), list(conditions), handed is not None, commit
        )
    if update is None:
        return False
    field = state_field(model)
    pk = model._meta.pk
    assert pk is not None
    args: list[Any] = [field.get_db_prep_save(ran.target, conn)]
    written = zip(update.values, ran.values.values(), strict=True)
    args += [f.get_db_prep_save(v, conn) for f, v in written]
    args += [pk.get_db_prep_value(order.pk, conn), field.get_db_prep_value(ran.source, conn)]
    args.append(version)
    tested = zip(update.conditions, conditions.values(), strict=True)
    args += [f.get_db_prep_value(v, conn) for f, v in tested]
    if handed is not None:
        args += [f.get_db_prep_save(handed[1].fields[f.name], conn) for f in update.queued]
    sql, tail = (update.sql[: -len(_COMMIT)], _COMMIT) if commit else (update.sql, "")
    try:
        for _ in range(_send(conn, cursor, "", [(sql, _named(sql), args)], tail)):
            cursor.nextset()
        row = cursor.fetchone()
    except DataError as exc:
        if getattr(exc.__cause__, "sqlstate", None) == _MOVED:
            raise Conflict from None
        raise
    except (ProgrammingError, NotSupportedError) as exc:
        if missed(conn, exc):
            raise Conflict from None  # rolled back whole: the usual road runs it again
        raise
    order.__dict__["version"] = version + 1
    if handed is not None and row[1] is not None:  # NULL: the message was queued already
        handed[1].written(conn.alias, row[1])
    result = TransitionResult(TransitionStatus.APPLIED, ran.source, ran.target, version + 1)
    transition_written(
        order, ran.name, result, fsm_sent=True, handed=() if handed is None else (handed[0],)
    )
    return True
