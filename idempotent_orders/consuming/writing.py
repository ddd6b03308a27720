"""The road: a message claimed, its order read, decided, and the verdict written, in one
transaction, on every database (:func:`apply`). The verdict's writes: the model's own
transition committed (:func:`~idempotent_orders.consuming.running.commit`: the model's
``save()`` or one conditional UPDATE), a message parked, or the order's ``last_seq``
moved on; the inbox row says what was decided.

The fast paths (:mod:`~idempotent_orders.consuming.backends`) run before it, where nothing
of the project's would, and decline, writing nothing, what they cannot take.
:func:`~idempotent_orders.consuming.single.consume_message` calls :func:`apply` again
while it raises :class:`Conflict` (another writer moved the order since the read);
:class:`Duplicate` says the message was there already.

The claim comes first: the message's inbox row as an applied message's (a retry takes its
failed row, a release its parked row), then the read (on MariaDB the read comes first,
``FOR UPDATE``, before the inbox row's foreign key share-locks the order); a verdict
other than "apply" rewrites the row in the same transaction.

Where the backend sends several statements a text (its
:class:`~idempotent_orders.consuming.backends.Texts`), a new message's statements go in
two texts (:func:`_in_two_texts`):

1. the transaction's opening, the claim of the message as applied with its spent
   payment, and the read of the order; then, in Python,
   :func:`~idempotent_orders.consuming.decision.decide` on the order as read and the
   model's own transition (:func:`run`, as for every message);
2. the conditional UPDATE (pk, state, version and the road's conditions), the
   follow-up's outbox row and ``COMMIT``: an order that moved since the read stops the
   text before ``COMMIT``, and the transaction rolls back. Where the model's ``save()``
   runs the project's code (:func:`~idempotent_orders.consuming.running.save_hooks`),
   :func:`settle` calls it, its UPDATE held for the next text
   (:mod:`~idempotent_orders.consuming.held`), and the follow-up's row and ``COMMIT`` go
   in one text.

Inside a caller's transaction the same two texts open and end the message's savepoint
instead (``SAVEPOINT`` at the head of the first, its release in place of ``COMMIT``:
:func:`~idempotent_orders.consuming.backends.atomic_block`), and a declined message is
rolled back to it.

Any decision but "apply" (the spent payment would have to be taken back), a duplicate,
a spent payment, an order with parked messages, an order that moved, or a write only
the ORM can make, rolls the two texts back
(:class:`~idempotent_orders.consuming.backends.Declined`), and the same attempt goes
one statement at a time, as on a database without texts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import cache, partial
from typing import Any

from django.db import DEFAULT_DB_ALIAS, IntegrityError, OperationalError, connections, transaction
from django.db.models import F, Field, Model
from django.utils import timezone

from idempotent_orders.consuming.backends import Block, Declined, FirstText, Texts, backend
from idempotent_orders.consuming.decision import (
    REFUND,
    Verdict,
    decide,
)
from idempotent_orders.consuming.envelope import (
    BODY_EXCERPT,
    Envelope,
    serialise,
)
from idempotent_orders.consuming.failures import (
    RETRYABLE,
    describe,
    is_retryable,
)
from idempotent_orders.consuming.graph import TransitionResult, TransitionStatus, state_field
from idempotent_orders.consuming.held import HeldUpdate
from idempotent_orders.consuming.payments import payment_id, spend
from idempotent_orders.consuming.running import (
    FollowUp,
    FollowUpRow,
    Ran,
    call_transition,
    commit,
    follow_up_rows,
    guarded_update_sql,
    keeps_parked_flag,
    save_hooks,
    still_committable,
    transition_written,
)
from idempotent_orders.consuming.sql import build, compiled_read, handed_over, read_order
from idempotent_orders.consuming.unread import fits
from idempotent_orders.models import (
    PLAIN_TYPES,
    AbstractOrder,
    InboxStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
    SpentPayment,
)

__all__ = [
    "Conflict",
    "Duplicate",
    "MissingOrder",
    "Spent",
    "StillParked",
    "apply",
    "on_error_reason",
    "park",
    "settle",
    "spent_verdict",
]

logger = logging.getLogger("idempotent_orders")


class Conflict(Exception):
    """The order changed between our read and our conditional write: decide again."""


class Duplicate(Exception):
    """The inbox already holds this (consumer, message_id)."""


class Spent(Exception):
    """The message's payment id already paid an order (``owner``)."""

    def __init__(self, payment: str, owner: Any) -> None:
        super().__init__(payment, owner)
        self.payment = payment
        self.owner = owner


def spent_verdict(envelope: Envelope, order: AbstractOrder, spent: Spent) -> Verdict:
    """What a message whose payment was spent already does: a duplicate on its own order,
    money to give back on any other."""
    seq = envelope.seq
    slot = seq if seq is not None and seq == order.last_seq + 1 else None
    if spent.owner == order.pk:
        reason = f"payment {spent.payment} was already applied to this order"
        return Verdict(Outcome.DUPLICATE, reason, advance_to=slot)
    reason = f"payment {spent.payment} already paid order {spent.owner}; {REFUND}"
    return Verdict(Outcome.REJECTED, reason, advance_to=slot)


class MissingOrder(Exception):
    """The message's order does not exist: nothing was written."""


class StillParked(Exception):
    """A released message must still wait: its release was rolled back."""


def apply(
    envelope: Envelope,
    consumer: str,
    model: type[Model],
    parked: ParkedMessage | None = None,
    *,
    retrying: bool = False,
) -> tuple[Outcome, AbstractOrder, Verdict]:
    """One attempt of the road, in one transaction: claim the message, read its order,
    decide, write the verdict; the outcome, the order as read and the verdict. Raises
    :class:`Duplicate` (the claim found the message taken), :class:`Conflict` (the order
    moved since the read: decide again), :class:`MissingOrder`, :class:`StillParked`;
    an exception from the project's code propagates after the rollback.

    ``parked``: the message is being released (its parked row is the claim, its inbox
    row exists); ``retrying``: the message has a failed inbox row, which the claim takes.
    A new message goes in two texts where the backend can (:func:`_in_two_texts`).
    """
    if parked is None and not retrying:
        done = _in_two_texts(envelope, consumer, model)
        if done is not None:
            return done
    # The order is locked before the claim where the inbox row's foreign key would
    # share-lock it (MariaDB), else read after the claim: there the claim's INSERT takes
    # the write lock first (SQLite), and the foreign key is checked at COMMIT.
    lock_first = backend().locks_orders_first
    with transaction.atomic():
        order = read_order(model, envelope.order_id, lock=True) if lock_first else None
        if lock_first and order is None:
            raise MissingOrder
        spent = _claim(envelope, consumer, parked, retrying)
        if not lock_first:
            order = read_order(model, envelope.order_id)
            if order is None:
                raise MissingOrder  # rolls the claim back
        assert isinstance(order, AbstractOrder)
        verdict = decide(order, envelope)
        if parked is not None and verdict.outcome is Outcome.PARKED:
            raise StillParked  # the parked row stays
        outcome, verdict = _write(envelope, consumer, order, verdict, parked, spent)
    return outcome, order, verdict


def _claim(
    envelope: Envelope, consumer: str, parked: ParkedMessage | None, retrying: bool
) -> list[Any] | None:
    """The transaction's first write takes the message: its inbox row as an applied
    message's (:func:`_write` records any other verdict), the failed row of a retry, or
    the parked row of a release. Raises :class:`Duplicate` when it is taken already.

    Where the backend claims and spends in one statement, a new message's payment is
    spent with the claim: ``[owner]`` (None: recorded; else the order it paid before);
    None: not spent yet."""
    if parked is not None:
        if not ParkedMessage.objects.filter(pk=parked.pk).delete()[0]:
            raise Duplicate  # another worker released it
        return None
    row = {
        "status": InboxStatus.DONE,
        "outcome": Outcome.APPLIED,
        "order_id": envelope.order_id,
        "seq": envelope.seq,
        "error": "",
        "body": "",
        "fingerprint": envelope.fingerprint,
    }
    if retrying:
        claimed = ProcessedMessage.objects.filter(
            RETRYABLE, consumer=consumer, message_id=envelope.message_id
        ).update(**row, attempts=F("attempts") + 1, dead_at=None, updated_at=timezone.now())
        if not claimed:
            raise Duplicate  # another delivery ran it meanwhile
        return None
    payment = payment_id(envelope)
    if payment is not None:
        fields = {**envelope.inbox_fields(consumer), **row}
        try:
            done = backend().claim_and_spend(fields, timezone.now(), payment, envelope.order_id)
        except IntegrityError:
            raise Duplicate from None
        if done is not None:
            if not done[0]:
                raise Duplicate
            return [done[1]]
    try:
        with transaction.atomic(savepoint=False):
            ProcessedMessage.objects.create(
                consumer=consumer,
                message_id=envelope.message_id,
                message_type=envelope.message_type,
                **row,
            )
    except IntegrityError:
        raise Duplicate from None
    return None


def _write(
    envelope: Envelope,
    consumer: str,
    order: AbstractOrder,
    verdict: Verdict,
    parked: ParkedMessage | None,
    spent: list[Any] | None = None,
) -> tuple[Outcome, Verdict]:
    """Write ``verdict`` in the claim's transaction: spend the payment and run the
    transition, park, or move ``last_seq`` on; the inbox row says what was decided.
    The outcome and the verdict as written (a spent payment's, where it was spent).
    ``spent``: the claim spent the payment already (:func:`_claim`)."""
    # A write that may unblock a successor is conditional on the has_parked
    # flag as read, so a message parked since our read makes it conflict.
    flagged = order.has_parked or not keeps_parked_flag(type(order))
    unflagged: dict[str, Any] = {} if flagged else {"has_parked": False}
    payment = payment_id(envelope)
    if spent is not None and spent[0] is None and not verdict.transition:
        # Spent with the claim, by a message that does not apply: taken back.
        SpentPayment.objects.filter(payment_id=payment, message_id=envelope.message_id).delete()
    elif payment is not None and verdict.transition:
        owner = (
            spend(payment, order.pk, consumer, envelope.message_id) if spent is None else spent[0]
        )
        if owner is not None:
            verdict = spent_verdict(envelope, order, Spent(payment, owner))
    outcome = verdict.outcome
    if parked is not None or outcome is not Outcome.APPLIED:
        recorded: dict[str, Any] = {
            "outcome": outcome,
            "status": verdict.inbox_status,
            "error": verdict.reason,
        }
        if parked is not None:
            recorded["attempts"] = F("attempts") + 1
        elif outcome is Outcome.REJECTED:
            recorded["body"] = serialise(envelope.as_dict())[:BODY_EXCERPT]
        inbox = ProcessedMessage.objects.filter(consumer=consumer, message_id=envelope.message_id)
        inbox.update(**recorded)
    if verdict.transition:
        extra: dict[str, Any] = dict(unflagged)
        if envelope.seq is not None:
            extra["last_seq"] = envelope.seq - 1
        outcome = run(envelope, consumer, order, verdict, extra)
    elif outcome is Outcome.PARKED:
        if not park(consumer, envelope, order, verdict.reason):
            # Another message already waits with this (order, seq): a producer bug.
            reason = f"another message is already parked with seq {envelope.seq}"
            ProcessedMessage.objects.filter(
                consumer=consumer, message_id=envelope.message_id
            ).update(outcome=Outcome.REJECTED, status=InboxStatus.REJECTED, error=reason)
            outcome = Outcome.REJECTED
        elif not flagged:
            # In the parking transaction, so that a predecessor's
            # conditional write either sees it or commits before it.
            type(order)._default_manager.filter(pk=order.pk).update(has_parked=True)
    elif verdict.advance_to is not None:
        # The message used up its sequence slot without changing the state:
        # advance last_seq so its successors are not parked forever.
        advanced = (
            type(order)
            ._default_manager.filter(pk=order.pk, last_seq=order.last_seq, **unflagged)
            .update(last_seq=verdict.advance_to)
        )
        if advanced != 1:
            raise Conflict
    return outcome, verdict


#: The two texts' connection, block and backend texts, for :func:`run` to write through.
_Sent = tuple[Any, Any, Texts]


def run(
    envelope: Envelope,
    consumer: str,
    order: AbstractOrder,
    verdict: Verdict,
    conditions: Mapping[str, Any],
    sent: _Sent | None = None,
) -> Outcome:
    """Call the model's own transition and commit it with one conditional UPDATE.

    In the transaction that claimed the message. Raises Conflict when another
    writer changed the order since it was read (the caller reads and decides
    again); an exception from the body, a condition or a receiver propagates
    and rolls the transaction back. ``sent``: the message was claimed in the first of
    two texts (:func:`_in_two_texts`), and the write goes in the second.
    """
    version: int = order.version
    ran = call_transition(order, verdict.transition, verdict.kwargs, fields=verdict.values)
    last = held = None
    if sent is not None:
        if not save_hooks(type(order)) and _finish(order, ran, version, conditions, *sent):
            return Outcome.APPLIED
        # The model's own save() writes the order, its UPDATE held for the next text; the
        # follow-up's row goes with COMMIT.
        held = HeldUpdate.arm(sent[0], sent[2])
        last = partial(_queue_and_commit, *sent, held)
    return settle(envelope, consumer, order, ran, version, conditions, last=last, held=held)


def settle(
    envelope: Envelope,
    consumer: str,
    order: AbstractOrder,
    ran: Ran,
    version: int,
    conditions: Mapping[str, Any],
    *,
    last: Callable[[AbstractOrder, Ran], Collection[FollowUp] | None] | None = None,
    held: HeldUpdate | None = None,
) -> Outcome:
    """Commit what the model's transition did (``ran``, on ``order`` read at ``version``)
    with one conditional UPDATE and announce it: :func:`run`'s second half. Raises
    Conflict when the order changed; keeps an ``on_error`` body's exception as rejected.

    ``last``: called once the order is written (its ``save()`` and receivers done), to
    write the follow-ups' rows and commit in one text; it returns the follow-ups it
    wrote, or None having sent nothing (they are written here and Django commits).
    ``held``: where ``save()``'s UPDATE may wait for the next text
    (:class:`~idempotent_orders.consuming.held.HeldUpdate`)."""
    try:
        if not commit(order, ran, version, conditions, held):
            raise Conflict
        handed = last(order, ran) if last is not None and ran.error is None else None
        if held is not None and not held.settle():
            # The held UPDATE matched no row (the order moved since the read: decide again),
            # or the database refused it in the text of a statement whose error the
            # project's code swallowed: raised as its save() would have raised it.
            raise held.refused or Conflict()
        still_committable(connections[order._state.db or DEFAULT_DB_ALIAS])
    finally:
        if held is not None:
            held.close()
    result = TransitionResult(TransitionStatus.APPLIED, ran.source, ran.target, version + 1)
    transition_written(order, ran.name, result, fsm_sent=True, handed=handed or ())
    if ran.error is None:
        return Outcome.APPLIED
    # fsm-2's on_error: the body raised and the order moved to the error state,
    # which is committed, as fsm-2 and a save() would. The message is kept as
    # rejected, with what was raised.
    reason = on_error_reason(envelope, consumer, order, ran.name, ran)
    ProcessedMessage.objects.filter(consumer=consumer, message_id=envelope.message_id).update(
        outcome=Outcome.REJECTED,
        status=InboxStatus.REJECTED,
        error=reason,
        body=serialise(envelope.as_dict()),
    )
    return Outcome.REJECTED


def on_error_reason(
    envelope: Envelope, consumer: str, order: AbstractOrder, name: str, ran: Ran
) -> str:
    """Why a message whose body raised under fsm-2's ``on_error`` is kept as rejected
    (logged here); its inbox row keeps the whole envelope as its body."""
    assert ran.error is not None
    reason = (
        f"{name} raised {describe(ran.error)}; the order moved to its on_error state {ran.target}"
    )
    logger.warning(
        "message %s (%s): %s",
        envelope.message_id,
        consumer,
        reason,
        extra={"message_id": envelope.message_id, "order_id": order.pk},
    )
    return reason


def park(consumer: str, envelope: Envelope, order: AbstractOrder, reason: str) -> bool:
    """Keep ``envelope`` until it can go ahead; False when its ``(order, seq)`` is taken."""
    try:
        with transaction.atomic():
            ParkedMessage.objects.create(
                consumer=consumer,
                message_id=envelope.message_id,
                order_id=order.pk,
                seq=envelope.seq,
                envelope=envelope.as_dict(),
                reason=reason[:255],
            )
    except IntegrityError:
        return False
    return True


def _in_two_texts(
    envelope: Envelope, consumer: str, model: type[Model]
) -> tuple[Outcome, AbstractOrder, Verdict] | None:
    """A new message applied in two texts (see the module's docstring) where the backend
    sends several statements a text; None with nothing written: the road goes on one
    statement at a time. Committed on APPLIED (or REJECTED: the body raised under fsm-2's
    ``on_error``); an exception from the project's code propagates after the rollback."""
    alias, plan = compiled_read(model, "pk")
    if plan is None or alias != DEFAULT_DB_ALIAS:
        return None
    conn = connections[alias]
    chosen = backend(conn)
    texts = chosen.texts() if chosen.two_texts else None
    if texts is None:
        return None
    nested = conn.in_atomic_block
    if nested and (conn.needs_rollback or not conn.features.uses_savepoints):
        return None  # in a caller's transaction the block is a savepoint: it has none
    if not nested and not conn.get_autocommit():
        return None
    if (not nested or chosen.unread_in_savepoint) and fits(envelope, model, several=chosen.at_once):
        # The fast path's kind (at_once tests the state against several sources;
        # one_statement against one): it took the message, or declined it for a reason
        # the order gave.
        return None
    if not chosen.several_statements(conn):
        return None
    payment = payment_id(envelope)
    try:
        # One cursor for both texts (the project's code in between may use its own).
        with texts.transaction(conn) as block:
            order = _claim_and_read(envelope, consumer, model, conn, block, texts, plan, payment)
            verdict = decide(order, envelope)
            if verdict.outcome is not Outcome.APPLIED:
                raise Declined
            # The road's conditions (_write): the flag as read, where the app keeps it
            # (elsewhere the caller looks for parked successors after commit).
            conditions: dict[str, Any] = {"has_parked": False} if keeps_parked_flag(model) else {}
            if envelope.seq is not None:
                conditions["last_seq"] = envelope.seq - 1
            sent = (conn, block, texts)
            return run(envelope, consumer, order, verdict, conditions, sent), order, verdict
    except (Declined, Conflict):
        return None
    except OperationalError as exc:
        if not is_retryable(exc):
            raise
        return None  # rolled back whole (a deadlock, say): the road goes on as below


def _claim_and_read(
    envelope: Envelope,
    consumer: str,
    model: type[Model],
    conn: Any,
    block: Block,
    texts: Texts,
    plan: Any,
    payment: str | None,
) -> AbstractOrder:
    """The first text: claim the message as applied (and spend its payment), read the
    order. Raises Declined for a duplicate, a spent payment, an unknown order, or an
    order with parked messages (the road answers those after a read of its own)."""
    pk = model._meta.pk
    assert pk is not None
    read_args = [pk.get_db_prep_value(envelope.order_id, conn)]
    inbox = envelope.inbox_fields(consumer)
    spent = None if payment is None else [payment, envelope.order_id, consumer, envelope.message_id]
    row = texts.claim_and_read(conn, block, FirstText(inbox, spent, plan.sql, read_args))
    order = build(model, conn.alias, plan, row)
    if order.has_parked:  # type: ignore[attr-defined]
        raise Declined  # released after the write, by the road's own read
    return order  # type: ignore[return-value]


def _follow_up(
    model: type[Model], pk: Any, ran: Ran
) -> tuple[bool, tuple[FollowUp, FollowUpRow] | None]:
    """Whether the last text may end the block (``COMMIT``, or the savepoint's release: no
    follow-up writes on its own after it), and the one follow-up whose outbox row that
    text writes, if any."""
    rows = follow_up_rows(model, pk, ran.name, ran.target)
    handed: tuple[FollowUp, FollowUpRow] | None = None
    if rows and len(rows) == 1 and handed_over(rows[0][1].fields):
        handed = rows[0]
    return rows is not None and (not rows or handed is not None), handed


def _queue_and_commit(
    conn: Any, block: Block, texts: Texts, held: HeldUpdate | None, order: AbstractOrder, ran: Ran
) -> tuple[FollowUp, ...] | None:
    """After the model's ``save()`` and its receivers: the follow-up's outbox row and
    ``COMMIT`` in one text (:meth:`Texts.queue`), after ``save()``'s UPDATE where it was
    held for it; the follow-up it wrote, or None with nothing sent (several follow-ups,
    or one that writes its own row: Django commits)."""
    _, handed = _follow_up(type(order), order.pk, ran)
    if handed is None:
        return None
    if held is not None and held.moved:
        raise held.refused or Conflict()
    update = None if held is None else held.take()
    queued_id = texts.queue(conn, block, dict(handed[1].fields), update)
    if queued_id is not None:  # None: the message was queued already
        handed[1].written(conn.alias, queued_id)
    return (handed[0],)


_updates: dict[tuple[Any, ...], Any] = {}


@cache
def _by_attname(model: type[Model]) -> dict[str, Field[Any, Any]]:
    return {f.attname: f for f in model._meta.concrete_fields}


def _compile(
    conn: Any,
    model: type[Model],
    values: Sequence[str],
    conditions: Sequence[str],
    queued: bool,
    closes: bool,
) -> Any:
    """The backend's second text for ``values`` and ``conditions`` (attnames) as
    :func:`~idempotent_orders.consuming.running.commit` writes them; None when a column is
    not a plain one of the model's own table (the ORM writes it)."""
    concrete = model._meta.concrete_model
    assert concrete is not None
    meta = concrete._meta  # a proxy's table is its concrete model's
    by_attname = {f.attname: f for f in meta.concrete_fields}
    fields = [by_attname.get(name) for name in (*values, *conditions)]
    if meta.parents or any(f is None or f.model is not concrete or f.primary_key for f in fields):
        return None  # a parent's column (multi-table inheritance): the ORM writes it
    if any(hasattr(f, "get_placeholder") for f in fields):
        return None
    texts = backend(conn).texts()
    assert texts is not None
    column = str(state_field(model).column)
    sets, tests = [by_attname[n] for n in values], [by_attname[n] for n in conditions]
    return texts.compile(conn, guarded_update_sql(conn, meta, column, sets, tests), queued, closes)


def _finish(
    order: AbstractOrder,
    ran: Ran,
    version: int,
    conditions: Mapping[str, Any],
    conn: Any,
    block: Block,
    texts: Texts,
) -> bool:
    """The second text: write what the transition did, queue its follow-up and commit,
    then announce it (its publish and ``order_transitioned`` run after the block). False,
    with nothing sent, where :func:`settle` must."""
    if ran.error is not None or ran.saved:
        return False
    if any(
        type(v) not in PLAIN_TYPES and (hasattr(v, "resolve_expression") or isinstance(v, Model))
        for v in ran.values.values()
    ):
        return False
    model = type(order)
    closes, handed = _follow_up(model, order.pk, ran)
    key = (conn.alias, model, tuple(ran.values), tuple(conditions), handed is not None, closes)
    try:
        update = _updates[key]
    except KeyError:
        update = _updates[key] = _compile(
            conn, model, list(ran.values), list(conditions), handed is not None, closes
        )
    if update is None:
        return False
    field = state_field(model)
    pk = model._meta.pk
    assert pk is not None
    by_attname = _by_attname(model)
    args: list[Any] = [field.get_db_prep_save(ran.target, conn)]
    args += [by_attname[n].get_db_prep_save(v, conn) for n, v in ran.values.items()]
    args += [pk.get_db_prep_value(order.pk, conn), field.get_db_prep_value(ran.source, conn)]
    args.append(version)
    args += [by_attname[n].get_db_prep_value(v, conn) for n, v in conditions.items()]
    queued_id = texts.write(
        conn, block, update, args, None if handed is None else dict(handed[1].fields)
    )
    order.__dict__["version"] = version + 1
    if handed is not None and queued_id is not None:  # None: the message was queued already
        handed[1].written(conn.alias, queued_id)
    result = TransitionResult(TransitionStatus.APPLIED, ran.source, ran.target, version + 1)
    transition_written(
        order, ran.name, result, fsm_sent=True, handed=() if handed is None else (handed[0],)
    )
    return True
