"""The read-decide-write road's transaction: claim the message, run the model's own
transition, commit it (:func:`~idempotent_orders.consuming.running.commit`: the model's
``save()`` or one conditional UPDATE), and park what must wait.

This is the one road once the order was read, on every database: the fast paths
(:mod:`~idempotent_orders.consuming.backends`) run before the read, where nothing of the
project's would, and decline, writing nothing, what they cannot take.

:func:`~idempotent_orders.consuming.single.consume_message` reads the order, decides,
and calls :func:`write`; the exceptions here tell it to decide again
(:class:`Conflict`, :class:`Spent`) or that the message was there already
(:class:`Duplicate`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from idempotent_orders.consuming.backends import backend
from idempotent_orders.consuming.decision import (
    REFUND,
    Verdict,
)
from idempotent_orders.consuming.envelope import (
    BODY_EXCERPT,
    Envelope,
    serialise,
)
from idempotent_orders.consuming.failures import (
    RETRYABLE,
    describe,
)
from idempotent_orders.consuming.graph import TransitionResult, TransitionStatus
from idempotent_orders.consuming.payments import payment_id, spend
from idempotent_orders.consuming.running import (
    FollowUp,
    Ran,
    call_transition,
    commit,
    keeps_parked_flag,
    transition_written,
)
from idempotent_orders.models import (
    AbstractOrder,
    InboxStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)

__all__ = [
    "Conflict",
    "Duplicate",
    "Spent",
    "on_error_reason",
    "park",
    "settle",
    "spent_verdict",
    "write",
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


def write(
    envelope: Envelope,
    consumer: str,
    order: AbstractOrder,
    verdict: Verdict,
    parked: ParkedMessage | None,
    *,
    retrying: bool = False,
) -> Outcome:
    """Write ``verdict`` in one transaction; raise Duplicate or Conflict when it cannot.

    ``retrying``: the message has a failed inbox row, which is claimed by a
    conditional update instead of an insert.
    """
    outcome = verdict.outcome
    # A write that may unblock a successor is conditional on the has_parked
    # flag as read, so a message parked since our read makes it conflict.
    flagged = order.has_parked or not keeps_parked_flag(type(order))
    unflagged: dict[str, Any] = {} if flagged else {"has_parked": False}
    body = serialise(envelope.as_dict())[:BODY_EXCERPT] if outcome is Outcome.REJECTED else ""
    # The payment id the transition spends (recorded with the claim where it can be).
    payment = payment_id(envelope) if verdict.transition else None
    with transaction.atomic():
        # The first statement claims the message: the inbox insert (the unique
        # index decides duplicates), or for a release, deleting the parked row.
        row = {
            "status": verdict.inbox_status,
            "outcome": outcome,
            "order_id": order.pk,
            "seq": envelope.seq,
            "error": verdict.reason,
            "body": body,
            "fingerprint": envelope.fingerprint,
        }
        if retrying:
            claimed = ProcessedMessage.objects.filter(
                RETRYABLE, consumer=consumer, message_id=envelope.message_id
            ).update(**row, attempts=F("attempts") + 1, dead_at=None, updated_at=timezone.now())
            if not claimed:
                raise Duplicate  # another delivery ran it meanwhile
        elif parked is None and payment is not None and (chosen := backend()).one_statement:
            # The claim and the spent payment in one statement (one round trip).
            fields = {"consumer": consumer, "message_id": envelope.message_id, **row}
            fields["message_type"] = envelope.message_type
            try:
                claimed, owner = chosen.claim_and_spend(fields, timezone.now(), payment, order.pk)
            except IntegrityError:
                raise Duplicate from None
            if not claimed:
                raise Duplicate
            if owner is not None:
                raise Spent(payment, owner)
            payment = None  # recorded
        elif parked is None:
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
        else:
            claimed, _ = ParkedMessage.objects.filter(pk=parked.pk).delete()
            if not claimed:
                raise Duplicate  # another worker released it
            ProcessedMessage.objects.filter(
                consumer=consumer, message_id=envelope.message_id
            ).update(
                outcome=outcome,
                status=verdict.inbox_status,
                error=verdict.reason,
                attempts=F("attempts") + 1,
            )

        if verdict.transition:
            if payment is not None:
                owner = spend(payment, order.pk, consumer, envelope.message_id)
                if owner is not None:
                    raise Spent(payment, owner)
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
                ).update(
                    outcome=Outcome.REJECTED,
                    status=InboxStatus.REJECTED,
                    error=reason,
                )
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
    return outcome


def run(
    envelope: Envelope,
    consumer: str,
    order: AbstractOrder,
    verdict: Verdict,
    conditions: Mapping[str, Any],
) -> Outcome:
    """Call the model's own transition and commit it with one conditional UPDATE.

    In the transaction that claimed the message. Raises Conflict when another
    writer changed the order since it was read (the caller reads and decides
    again); an exception from the body, a condition or a receiver propagates
    and rolls the transaction back.
    """
    version: int = order.version
    ran = call_transition(order, verdict.transition, verdict.kwargs, fields=verdict.values)
    return settle(envelope, consumer, order, ran, version, conditions)


def settle(
    envelope: Envelope,
    consumer: str,
    order: AbstractOrder,
    ran: Ran,
    version: int,
    conditions: Mapping[str, Any],
    *,
    last: Callable[[AbstractOrder, Ran], Collection[FollowUp] | None] | None = None,
) -> Outcome:
    """Commit what the model's transition did (``ran``, on ``order`` read at ``version``)
    with one conditional UPDATE and announce it: :func:`run`'s second half. Raises
    Conflict when the order changed; keeps an ``on_error`` body's exception as rejected.

    ``last``: called once the order is written (its ``save()`` and receivers done), to
    write the follow-ups' rows and commit in one text; it returns the follow-ups it
    wrote, or None having sent nothing (they are written here and Django commits)."""
    if not commit(order, ran, version, conditions):
        raise Conflict
    result = TransitionResult(TransitionStatus.APPLIED, ran.source, ran.target, version + 1)
    handed = last(order, ran) if last is not None and ran.error is None else None
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
