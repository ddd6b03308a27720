"""PostgreSQL's road without a read: a message's "apply" decided in SQL, in one statement.

For a message :func:`~idempotent_orders.consuming.unread.plan` takes (one source, a
built-in rule, nothing of the project's to run),
:func:`~idempotent_orders.consuming.decision.decide` says "apply" exactly when a few
column tests hold on the order (state, ``has_parked``, ``last_seq``, the rule's
comparisons such as the amount and currency of a payment). Those tests go into the
UPDATE's WHERE clause, and the claim into the same statement, committed on its own
(prepared once per database session, see :func:`~idempotent_orders.prepared.fetch_one`):

``WITH claim AS (INSERT inbox ... ON CONFLICT DO NOTHING),
moved AS (UPDATE order SET ... WHERE pk AND <the tests> AND the claim happened
RETURNING the new row)``. A follow-up that hands its outbox row over as data
(``outbox_row``, see :class:`~idempotent_orders.consuming.running.FollowUpRow`) has it
written by the same statement (``queued AS (INSERT outbox ... WHERE EXISTS (moved)
ON CONFLICT (message_id) DO NOTHING)``); any other follow-up puts the statement in a
transaction with it.

Inside a caller's transaction the statement goes in the message's savepoint, in one text
with it (:func:`~idempotent_orders.consuming.backends.atomic_block`): ``SAVEPOINT``, the
statement, ``RELEASE SAVEPOINT`` (unless a follow-up writes its own rows after it); a
statement that wrote nothing is rolled back to the savepoint, and the caller's
transaction goes on.

PostgreSQL checks the WHERE clause on the row version it locks (a concurrent
writer's committed change included), so the tests hold on the order the
update writes. Every test is at least as strict as the Python validator (text
compared bytewise, ``COLLATE "C"``); anything else (the tests fail, a duplicate, a
value the column cannot take) writes nothing and the message is read, decided and
written by :mod:`~idempotent_orders.consuming.writing`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import (
    DEFAULT_DB_ALIAS,
    DataError,
    NotSupportedError,
    ProgrammingError,
    connections,
    transaction,
)
from django.db.models import DateTimeField, Field, Model
from django.utils import timezone

from idempotent_orders.consuming.backends import Block, atomic_block
from idempotent_orders.consuming.backends.postgresql import send_first, spent_after
from idempotent_orders.consuming.envelope import Envelope
from idempotent_orders.consuming.payments import SPENT_FIELDS
from idempotent_orders.consuming.running import written_values
from idempotent_orders.consuming.sql import (
    FOLLOW_UP_FIELDS,
    inbox_partitioned,
    inbox_preparation,
    inbox_template,
    plain_type,
    preparation,
    queue_follow_up,
)
from idempotent_orders.consuming.unread import Plan, Shape, plan, update_sql, written
from idempotent_orders.models import Outcome, SpentPayment
from idempotent_orders.prepared import PreparedMissing, driver_cursor, fetch_one, missed
from idempotent_orders.signals import order_transitioned

__all__ = ["apply_unread"]


class _Arguments:
    """The arguments of a statement being written, handed out as ``%(a<n>)s`` placeholders.

    One argument per source of a value and the preparation it gets, so a value
    the statement uses twice (the time, a payment id both written and tested)
    is sent once.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._index: dict[tuple[Any, ...], int] = {}
        #: ``(source, preparation)`` of each argument, in order.
        self.sources: list[tuple[str, _Prepare]] = []

    def ref(self, source: str, field: Field[Any, Any], prepare: _Prepare) -> str:
        # Django's own text, integer and time fields prepare a value the same
        # whatever their options: one argument serves every such column of a type.
        kind = type(field)
        owner: Any = kind if kind is DateTimeField or plain_type(field) else field
        key = (source, owner, field.db_type(self._conn))
        n = self._index.get(key)
        if n is None:
            n = self._index[key] = len(self.sources)
            self.sources.append((source, prepare))
        return f"%(a{n})s"


#: Prepares an argument's value for the database: ``(value, connection) -> value``.
_Prepare = Callable[[Any, Any], Any]


def _literal(conn: Any, value: Any) -> str:
    """``value`` as an SQL literal in a statement text (``%`` doubled for the driver)."""
    return str(conn.ops.compose_sql("%s", [value])).replace("%", "%%")


@dataclass(frozen=True)
class _Statement:
    """The claim-and-apply statement of one kind of message, and where its arguments come from.

    The columns no message changes (the inbox row's status and defaults, the
    transition's source and target) are literals in its text, composed once.
    """

    sql: str
    #: ``(source, preparation)`` of each ``%(a<n>)s``: see :func:`_arguments`.
    sources: tuple[tuple[str, _Prepare], ...]


def _compile(
    conn: Any,
    model: type[Model],
    shape: Shape,
    value_names: list[str],
    tests: list[tuple[str, bool, bool]],
    seq: bool,
    attnames: tuple[str, ...],
    spends: str = "",
    queued: tuple[str, ...] = (),
) -> _Statement:
    """The statement for a message writing ``value_names`` and testing ``tests``.

    ``tests`` are ``(field name, empty allowed, same value as the written field)``.
    ``spends`` (the source of the payment id, or ""): the message carries money;
    its payment id is recorded as spent
    (:mod:`idempotent_orders.consuming.payments`) in the same statement, and a payment id
    spent already leaves the order alone (the usual path then says why).
    ``queued`` (the outbox fields a follow-up handed over, or none): its outbox row is
    inserted by the statement too, when the UPDATE applied (``ON CONFLICT (message_id)
    DO NOTHING``); the statement returns the row's id (NULL: not written) third.
    """
    template = inbox_template()
    args = _Arguments(conn)
    per_message = {"consumer", "message_id", "message_type", "order_id", "seq", "fingerprint"}
    inserted = []
    for field, base in zip(template.fields, template.base, strict=True):
        if field.attname in per_message:
            inserted.append(args.ref(field.attname, field, inbox_preparation(field)))
        elif field.attname == "updated_at":
            inserted.append(args.ref("now", field, preparation(field)))
        else:  # as in every applied message's row: the template's own value
            inserted.append(_literal(conn, base))
    (leaves,) = shape.sources  # one state tested (unread.plan's default)
    shared = {name for name, _, same in tests if same}

    def place(role: str, field: Field[Any, Any]) -> str:
        kind, _, name = role.partition(":")
        if kind in ("target", "source"):
            return _literal(conn, shape.target if kind == "target" else leaves)
        if kind == "value":
            source = {"updated_at": "now", "last_seq": "seq"}.get(name, f"set:{name}")
        elif kind == "test":
            source = f"set:{name}" if name in shared else f"test:{name}"
        else:
            source = {"pk": "order_id"}.get(kind, kind)
        return args.ref(source, field, preparation(field))

    tested = [(name, empty) for name, empty, _ in tests]
    update = update_sql(model, place, 1, value_names, tested, seq, conn)
    qn = conn.ops.quote_name
    meta = model._meta
    by_attname = {f.attname: f for f in meta.concrete_fields}
    # Without anyone to hand the order to, the statement returns none of it.
    returning = ", ".join(qn(str(by_attname[a].column)) for a in attnames) or "1"
    spent = ""
    if spends:
        sfields = [SpentPayment._meta.get_field(n) for n in SPENT_FIELDS]
        refs = [
            args.ref(source, f, inbox_preparation(f))  # type: ignore[arg-type]
            for source, f in zip(
                (spends, "order_id", "consumer", "message_id"), sfields, strict=True
            )
        ]
        spent = f" {spent_after('claim', refs)},"
        update += " AND EXISTS (SELECT 1 FROM spent)"
    outbox, queued_id = "", ""
    if queued:
        outbox = ", " + queue_follow_up(
            conn, queued, lambda source, f: args.ref(source, f, preparation(f))
        )
        queued_id = " (SELECT id FROM queued),"
    sql = (
        f"WITH claim AS ({template.insert(inserted)} RETURNING 1),{spent}"
        f" moved AS ({update} AND EXISTS (SELECT 1 FROM claim)"
        f" RETURNING {returning}){outbox}"
        " SELECT c.n, CASE WHEN c.n = 1 THEN 1 / (SELECT count(*) FROM moved) ELSE 0 END,"
        f"{queued_id} moved.* FROM (SELECT count(*) AS n FROM claim) c LEFT JOIN moved ON true"
    )
    return _Statement(sql, tuple(args.sources))


#: Statements by (database, model, transition, written fields, tests, with seq, announced).
_statements: dict[tuple[Any, ...], _Statement] = {}


def apply_unread(envelope: Envelope, consumer: str, model: type[Model]) -> Outcome | None:
    """Apply ``envelope`` in one statement when its verdict is "apply"; None: read first.

    Inside a caller's transaction it goes in the message's savepoint (see the module's
    docstring), where the driver takes it in one text with the savepoint's statements;
    else it declines there. On APPLIED the inbox row and the transition are committed
    (in a caller's transaction, released into it) and ``transition_written`` was called
    (when anyone listens for the order); the caller announces the outcome.
    """
    # The wrapper itself, not the ``connection`` proxy: each attribute read
    # through the proxy costs a context-local lookup.
    conn = connections[DEFAULT_DB_ALIAS]
    nested = conn.in_atomic_block
    if nested and (conn.needs_rollback or not conn.features.uses_savepoints):
        return None
    p = plan(envelope, model)
    if p is None:
        return None
    cursor = driver_cursor(conn, in_transaction=True) if nested else None
    if nested and cursor is None:
        return None  # something must see the statements: the road reads the message
    shape, name, fields, tests = p.shape, p.name, p.fields, p.tests
    # The order as written is built only for someone to hand it to: a receiver of
    # ``order_transitioned``, or a follow-up that writes its own row (then the statement
    # goes in a transaction with it: the statement, the follow-up and COMMIT).
    handed = p.handed
    follow_up = p.follow_ups is None
    announced = follow_up or order_transitioned.has_listeners(model)
    seq = envelope.seq
    shapes = tuple((t[0], t[2], t[0] in fields and fields[t[0]] == t[1]) for t in tests)
    payment = p.payment
    # The spent record's payment id is the one written on the order when it is (one argument).
    spends = (
        ""
        if payment is None
        else "set:payment_id"
        if fields.get("payment_id") == payment
        else "payment_id"
    )
    queued = FOLLOW_UP_FIELDS if handed is not None else ()
    partitioned = inbox_partitioned(conn)
    key = (
        DEFAULT_DB_ALIAS,
        partitioned,
        model,
        name,
        tuple(fields),
        shapes,
        seq is None,
        announced,
        spends,
        queued,
    )
    statement = _statements.get(key)
    if statement is None:
        names = list(
            written_values(model, {**fields, "last_seq": 0} if seq is not None else fields)
        )
        statement = _statements[key] = _compile(
            conn,
            model,
            shape,
            names,
            list(shapes),
            seq is not None,
            p.read.attnames if announced else (),
            spends,
            queued,
        )
    now = timezone.now()
    values: dict[str, Any] = {
        **envelope.inbox_fields(consumer),
        "previous_seq": None if seq is None else seq - 1,
        "now": now,
        "payment_id": payment,
    }
    for field_name, value in fields.items():
        values[f"set:{field_name}"] = value
    for field_name, value, _ in tests:
        values[f"test:{field_name}"] = value
    if handed is not None:
        for field_name, value in handed[1].fields.items():
            values[f"outbox:{field_name}"] = value
    args = [prepare(values[source], conn) for source, prepare in statement.sources]
    if cursor is not None:
        return _in_savepoint(statement, args, conn, cursor, model, p, announced, follow_up)
    if not follow_up:
        return _apply(statement, args, conn, model, p, announced)
    try:
        with transaction.atomic(using=DEFAULT_DB_ALIAS):
            applied = _apply(statement, args, conn, model, p, announced, True)
            if applied is None:
                raise _Declined  # nothing written; the transaction may be aborted: undo it
            return applied
    except (_Declined, PreparedMissing):
        return None  # rolled back: the usual path decides


class _Declined(Exception):
    """The statement wrote nothing: leave the transaction that held it."""


def _in_savepoint(
    statement: _Statement,
    args: list[Any],
    conn: Any,
    cursor: Any,
    model: type[Model],
    p: Plan,
    announced: bool,
    follow_up: bool,
) -> Outcome | None:
    """In a caller's transaction: the statement in one text with the message's savepoint,
    released at its end unless a follow-up writes its own rows after it; None (rolled
    back to the savepoint) when it wrote nothing."""
    try:
        with atomic_block(conn) as block, cursor:
            block.cursor = cursor
            applied = _apply(statement, args, conn, model, p, announced, follow_up, block)
            if applied is None:
                raise _Declined
            return applied
    except _Declined:
        return None


def _apply(
    statement: _Statement,
    args: list[Any],
    conn: Any,
    model: type[Model],
    p: Plan,
    announced: bool,
    in_transaction: bool = False,
    block: Block | None = None,
) -> Outcome | None:
    """Run the statement; on APPLIED announce the transition (follow-ups write here).

    ``in_transaction``: in the follow-up's ``atomic`` block, where the statement is
    prepared too (see :func:`~idempotent_orders.prepared.fetch_one`). ``block``: in a
    caller's transaction, the message's savepoint, sent in one text with the statement.
    """
    handed = None if in_transaction else p.handed
    try:
        if block is None:
            row = fetch_one(statement.sql, args, conn, in_transaction=in_transaction)
        else:
            closing = "" if in_transaction else "".join(f"; {sql}" for sql in block.closing)
            send_first(conn, block, [(None, statement.sql, args)], closing)
            row = block.cursor.fetchone()
            block.closed = bool(closing)
    except DataError:
        # The deliberate division by zero (the tests failed: nothing was written),
        # or a value a column cannot take: the usual path decides and says why.
        return None
    except (ProgrammingError, NotSupportedError) as exc:
        if block is not None and missed(conn, exc):
            return None  # the session lost the prepared statement: rolled back
        raise
    if row is None or not row[0]:
        return None  # a duplicate: the usual path reads the order and answers it
    start = 2
    if handed is not None:
        start = 3
        if row[2] is not None:  # NULL: the message id was in the outbox already
            handed[1].written(DEFAULT_DB_ALIAS, row[2])
    if announced:
        written(model, p, row[start:])
    return Outcome.APPLIED
