"""The decision: what one message does to its order, for the single and the batch consumer.

:func:`decide` is the only place where a message is judged against the order
as read (validation, sequence, the fsm-2 graph, the transition's conditions
and arguments). It returns a :class:`Verdict`: pure data that
:func:`~idempotent_orders.consuming.single.consume_message` carries out by
running the model's transition in one transaction, and
:func:`~idempotent_orders.consuming.batch.consume_batch` for many orders at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from django.db import transaction
from django.db.models import Model

from idempotent_orders.consuming.envelope import Envelope
from idempotent_orders.consuming.graph import (
    TransitionStatus,
    classify,
    current_state,
    may_apply_later,
    unmet_conditions,
)
from idempotent_orders.consuming.running import arguments, missing_arguments
from idempotent_orders.exceptions import InvalidMessage
from idempotent_orders.models import InboxStatus, Outcome, ProcessedMessage
from idempotent_orders.signals import message_consumed

__all__ = [
    "COUNTERS",
    "REFUND",
    "Verdict",
    "announce",
    "announce_known",
    "announce_many",
    "consumed",
    "decide",
    "parked_twice",
    "unknown_order",
]

REFUND = "the payment is money to give back"


@dataclass(frozen=True)
class Verdict:
    """What a message does to its order, decided against the order as read."""

    outcome: Outcome
    reason: str = ""
    #: The transition to apply (``outcome`` is ``applied``); empty otherwise.
    transition: str = ""
    #: Columns written on the order with the transition: payload fields and ``last_seq``.
    values: Mapping[str, Any] = field(default_factory=dict)
    #: A message that uses up its sequence slot without a transition moves ``last_seq`` here.
    advance_to: int | None = None
    #: The keyword arguments the transition method is called with.
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def inbox_status(self) -> InboxStatus:
        return InboxStatus.REJECTED if self.outcome is Outcome.REJECTED else InboxStatus.DONE


def decide(order: Model, envelope: Envelope) -> Verdict:
    """Judge ``envelope`` against ``order`` as read: pure, no writes (see :func:`_judge`).

    A message that carries money (``money=True``) and is rejected, for whatever
    reason (a second charge for a paid order, a charge for a cancelled order, one
    whose conditions fail, a payload that does not match the order), is money to
    give back: its reason says so, and the admin counts it there.
    """
    verdict = _judge(order, envelope)
    if (
        envelope.handler.money
        and verdict.outcome is Outcome.REJECTED
        and not verdict.reason.endswith(REFUND)
    ):
        return replace(verdict, reason=f"{verdict.reason}; {REFUND}")
    return verdict


def _judge(order: Model, envelope: Envelope) -> Verdict:
    """Judge ``envelope`` against ``order`` as read: pure, no writes.

    In this order: a message with ``seq`` at or below ``last_seq`` is stale, one
    beyond ``last_seq + 1`` is parked (an invalid one too: it is rejected in its
    turn, so that it still fills its slot); an invalid payload is rejected;
    then the fsm-2 graph says applied, duplicate (at the target), stale (past
    it), parked (reachable later) or rejected (never); a message that carries
    money is never stale: it is rejected as money to give back. A transition
    whose ``conditions=`` fail is parked when the message has no ``seq`` and
    the graph leads back to a state it may start from (the condition may hold
    later), and rejected with their names otherwise. A payload that lacks an
    argument the transition method requires is rejected. A message in
    sequence that changes no state still moves ``last_seq`` on.

    Applied means: call the model's own method with ``Verdict.kwargs``
    (``handler.arguments(order, payload)``, or the payload entries the method
    takes) and commit what it did.
    """
    seq = envelope.seq
    last: int = order.last_seq  # type: ignore[attr-defined]
    in_sequence = seq is not None and seq == last + 1
    slot = seq if in_sequence else None
    try:
        fields = envelope.handler.validate(order, envelope.payload)
    except InvalidMessage as exc:
        if seq is not None and seq > last + 1:
            return Verdict(Outcome.PARKED, f"waiting for seq {last + 1}")
        return Verdict(Outcome.REJECTED, exc.message, advance_to=slot)
    if seq is not None:
        if seq <= last:
            return Verdict(Outcome.STALE, f"seq {seq} is not after the last applied seq {last}")
        if seq > last + 1:
            return Verdict(Outcome.PARKED, f"waiting for seq {last + 1}")
    handler = envelope.handler
    name = handler.transition
    model = type(order)
    state = current_state(order)
    status = classify(model, name, state)
    if status is TransitionStatus.APPLIED:
        try:
            kwargs = (
                handler.arguments(order, envelope.payload)
                if handler.arguments is not None
                else arguments(model, name, envelope.payload)
            )
        except InvalidMessage as exc:
            return Verdict(Outcome.REJECTED, exc.message, advance_to=slot)
        missing = missing_arguments(model, name, kwargs)
        if missing:
            return Verdict(
                Outcome.REJECTED,
                f"payload lacks {', '.join(missing)}, which {model.__name__}.{name}() requires",
                advance_to=slot,
            )
        if getattr(model, name)._django_fsm.conditions_met(order, state):
            values = {**fields, "last_seq": seq} if seq is not None else fields
            return Verdict(Outcome.APPLIED, transition=name, values=values, kwargs=kwargs)
        unmet = ", ".join(unmet_conditions(order, name))
        if seq is None and may_apply_later(model, name, state):
            # The order can still change (a cycle through this state): the condition
            # may hold after another message. Kept, and looked at again then.
            return Verdict(Outcome.PARKED, f"order is {state}; {name} waits for {unmet} to hold")
        return Verdict(
            Outcome.REJECTED,
            f"order is {state}; {name} is not allowed: {unmet} does not hold",
            advance_to=slot,
        )
    if status is TransitionStatus.AT_TARGET:
        return Verdict(Outcome.DUPLICATE, f"order is already {state}", advance_to=slot)
    if status is TransitionStatus.PAST_TARGET:
        # The payment the order recorded (the validator's columns equal the order's)
        # is stale; any other one is money that cannot apply.
        same = bool(fields) and all(getattr(order, k, None) == v for k, v in fields.items())
        if handler.money and not same:
            return Verdict(
                Outcome.REJECTED,
                f"order has moved past this step (now {state}); {REFUND}",
                advance_to=slot,
            )
        return Verdict(
            Outcome.STALE, f"order has moved past this step (now {state})", advance_to=slot
        )
    if status is TransitionStatus.LATER:
        return Verdict(Outcome.PARKED, f"order is {state}; {name} is not possible yet")
    reason = f"order is {state}; {envelope.message_type} can never apply to it"
    if handler.money:
        reason += f"; {REFUND}"
    return Verdict(Outcome.REJECTED, reason, advance_to=slot)


def unknown_order(envelope: Envelope) -> Verdict:
    """The verdict for a message whose order does not exist."""
    return Verdict(Outcome.REJECTED, f"unknown order {envelope.order_id}")


def parked_twice(envelope: Envelope) -> Verdict:
    """The verdict for a message whose (order, seq) another parked message holds already:
    a producer's bug."""
    return Verdict(Outcome.REJECTED, f"another message is already parked with seq {envelope.seq}")


def consumed(
    consumer: str,
    message_id: str,
    outcome: Outcome,
    *,
    message_type: str = "",
    order_id: Any = None,
    reason: str = "",
) -> None:
    """Send :data:`~idempotent_orders.signals.message_consumed`: the one place that does.

    Every path that decides a message (single, batch, parked release, the
    fulfilment step, ``@idempotent``) reports its outcome through here, once what
    decided it is committed (``on_commit``: at once outside a transaction; inside a
    caller's, when it commits, never for one rolled back, whose redelivery reports the
    message again).
    """
    transaction.on_commit(
        partial(_send, consumer, message_id, outcome, message_type, order_id, reason)
    )


def _send(
    consumer: str, message_id: str, outcome: Outcome, message_type: str, order_id: Any, reason: str
) -> None:
    message_consumed.send(
        sender=ProcessedMessage,
        consumer=consumer,
        message_id=message_id,
        message_type=message_type,
        order_id=order_id,
        outcome=outcome,
        reason=reason,
    )


#: The app's own receivers of ``message_consumed`` that only count, by ``dispatch_uid``:
#: how each counts ``n`` messages of one consumer and outcome at once (set where they
#: are connected).
COUNTERS: dict[str, Callable[[str, Outcome, int], None]] = {}


def _counters_only() -> list[Callable[[str, Outcome, int], None]] | None:
    """The counting functions of ``message_consumed``'s receivers when every receiver is
    one of :data:`COUNTERS` (none at all: an empty list); None when anyone else listens."""
    uids = [entry[0][0] for entry in message_consumed.receivers]
    if all(uid in COUNTERS for uid in uids):
        return [COUNTERS[uid] for uid in uids]
    return None


def announce_many(consumer: str, reports: Sequence[tuple[Envelope, Outcome, str]]) -> None:
    """:func:`announce` for many messages, in order (``(envelope, outcome, reason)`` each).

    When every receiver of ``message_consumed`` is one of :data:`COUNTERS`, each counts
    once per outcome instead of once per message: all those receivers would do. A
    receiver anyone else connects gets the signal for every message, as before.
    """
    counters = _counters_only()
    if counters is not None:
        counts = Counter(outcome for _, outcome, _ in reports)
        transaction.on_commit(partial(_count, counters, consumer, counts))
        return
    for envelope, outcome, reason in reports:
        announce(consumer, envelope, outcome, reason)


def announce_known(
    consumer: str,
    message_id: str,
    outcome: Outcome,
    reason: str,
    described: Callable[[], tuple[str, Any]],
) -> None:
    """:func:`announce` for a message known by its id alone (a copy the fast path answers):
    where only :data:`COUNTERS` listen it is counted and the message is read no further;
    any other receiver gets the type and order ``described()`` reads from it. At once,
    even inside a caller's transaction: the copy was settled before it, by a commit."""
    counters = _counters_only()
    if counters is not None:
        for count in counters:
            count(consumer, outcome, 1)
        return
    message_type, order_id = described()
    _send(consumer, message_id, outcome, message_type, order_id, reason)


def _count(
    counters: Sequence[Callable[[str, Outcome, int], None]],
    consumer: str,
    counts: Mapping[Outcome, int],
) -> None:
    for count in counters:
        for outcome, n in counts.items():
            count(consumer, outcome, n)


def announce(consumer: str, envelope: Envelope, outcome: Outcome, reason: str) -> None:
    """:func:`consumed` for a parsed envelope (where only :data:`COUNTERS` listen, they
    count it without the signal, as :func:`announce_many` does)."""
    counters = _counters_only()
    if counters is not None:
        transaction.on_commit(partial(_count, counters, consumer, {outcome: 1}))
        return
    consumed(
        consumer,
        envelope.message_id,
        outcome,
        message_type=envelope.message_type,
        order_id=envelope.order_id,
        reason=reason,
    )
