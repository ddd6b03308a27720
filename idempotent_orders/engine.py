"""The decision engine: what one message does to its order, for the single and the batch consumer.

:func:`decide` is the only place where a message is judged against the order
as read (validation, sequence, the fsm-2 graph, the transition's conditions).
It returns a :class:`Verdict`: pure data that
:func:`~idempotent_orders.services.consume_message` writes with one
conditional UPDATE and :func:`~idempotent_orders.batch.consume_batch` writes
with one statement for many orders. Both paths differ only in that.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import OperationalError
from django.db.models import Model

from idempotent_orders.conf import conf
from idempotent_orders.exceptions import InvalidMessage
from idempotent_orders.handlers import MessageHandler, get_handler
from idempotent_orders.models import InboxStatus, Outcome, ProcessedMessage
from idempotent_orders.signals import message_consumed
from idempotent_orders.transitions import (
    TransitionStatus,
    arguments,
    classify,
    current_state,
    may_apply_later,
    missing_arguments,
    unmet_conditions,
)

__all__ = [
    "BODY_EXCERPT",
    "Envelope",
    "Verdict",
    "announce",
    "decide",
    "is_retryable",
    "parse_envelope",
    "unknown_order",
]

#: Stored excerpt of a rejected message's raw body.
BODY_EXCERPT = 4096
#: What a rejection of a message that carries money says (the operator gives it back).
REFUND = "the payment is money to give back"


@dataclass(frozen=True)
class Envelope:
    """A validated message envelope."""

    message_id: str
    message_type: str
    order_id: int
    seq: int | None
    payload: dict[str, Any]
    handler: MessageHandler

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 of what the message says (type, order, seq, payload), not of its id."""
        text = json.dumps(
            [self.message_type, self.order_id, self.seq, self.payload],
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=True,
            default=repr,
        )
        return hashlib.sha256(text.encode("ascii")).hexdigest()

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "message_id": self.message_id,
            "type": self.message_type,
            "order_id": self.order_id,
            "payload": self.payload,
        }
        if self.seq is not None:
            data["seq"] = self.seq
        return data


def has_nul(value: Any, depth: int = 0) -> bool:
    """Whether a NUL character hides anywhere in ``value`` (no database column stores one)."""
    if depth > 32:
        return False  # the size/serialisation check rejects absurd nesting
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, Mapping):
        return any(has_nul(k, depth + 1) or has_nul(v, depth + 1) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(has_nul(v, depth + 1) for v in value)
    return False


def valid_message_id(value: Any) -> bool:
    """Whether ``value`` can be a message id: a short printable string."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= conf.MAX_MESSAGE_ID_LENGTH
        and value.strip() == value
        and value.isprintable()
    )


def serialise(message: Any) -> str:
    """The message as escaped JSON text (no NUL bytes, no lone surrogates)."""
    try:
        return json.dumps(message, ensure_ascii=True, sort_keys=True, default=repr)
    except (TypeError, ValueError, RecursionError):
        try:
            text = repr(message)[:BODY_EXCERPT]
        except RecursionError:  # absurd nesting defeats repr() too
            text = f"<{type(message).__name__} nested too deeply to show>"
        return json.dumps(text, ensure_ascii=True)


def parse_envelope(message: Any, *, consumer: str | None = None) -> Envelope:
    """Validate a raw message; raise :class:`InvalidMessage` with a readable reason.

    With ``consumer``, a type restricted to other consumers is rejected too.
    """
    if not isinstance(message, Mapping):
        raise InvalidMessage(f"message must be a JSON object, got {type(message).__name__}")
    try:
        text = json.dumps(message, ensure_ascii=False)
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        # A lone surrogate (JSON allows "\ud800") cannot be stored in any database column.
        raise InvalidMessage("message contains an unpaired UTF-16 surrogate") from None
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidMessage(f"message is not JSON-serialisable: {str(exc)[:120]}") from None
    if size > conf.MAX_MESSAGE_BYTES:
        raise InvalidMessage(f"message is {size} bytes, the limit is {conf.MAX_MESSAGE_BYTES}")
    message_id = message.get("message_id")
    if not valid_message_id(message_id):
        raise InvalidMessage(
            "message_id must be a non-empty printable string of at most "
            f"{conf.MAX_MESSAGE_ID_LENGTH} characters without surrounding spaces"
        )
    # JSON writes a NUL as \u0000, so text without that sequence has none to look for.
    if "\\u0000" in text and has_nul(message):
        raise InvalidMessage("message contains a NUL character")
    message_type = message.get("type")
    if not isinstance(message_type, str):
        raise InvalidMessage("type must be a string")
    handler = get_handler(message_type)
    if handler is None:
        raise InvalidMessage(f"unknown message type {message_type[:64]!r}")
    if handler.consumers and consumer is not None and consumer not in handler.consumers:
        raise InvalidMessage(
            f"message type {message_type!r} is not accepted by the {consumer[:64]!r} consumer"
        )
    order_id = message.get("order_id")
    if isinstance(order_id, str) and order_id.isdigit() and len(order_id) < 19:
        order_id = int(order_id)
    if not isinstance(order_id, int) or isinstance(order_id, bool) or order_id <= 0:
        raise InvalidMessage("order_id must be a positive integer")
    seq = message.get("seq")
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool) or seq <= 0):
        raise InvalidMessage("seq must be a positive integer when present")
    if seq is not None and seq > 2**31 - 1:
        raise InvalidMessage("seq is too large")
    payload = message.get("payload", {})
    if not isinstance(payload, dict):
        raise InvalidMessage(f"payload must be a JSON object, got {type(payload).__name__}")
    return Envelope(
        message_id=str(message_id),
        message_type=message_type,
        order_id=order_id,
        seq=seq,
        payload=payload,
        handler=handler,
    )


def synthetic_id(message: Any) -> str:
    """A stable inbox id for a message whose own id is unusable, so copies dedup too."""
    digest = hashlib.sha256(serialise(message).encode("ascii")).hexdigest()
    return f"invalid:{digest}"


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


#: SQLSTATEs / MySQL error numbers after which the transaction was rolled back
#: whole (serialization failure, deadlock) and may simply run again.
_RETRYABLE_SQLSTATES = {"40001", "40P01"}
_RETRYABLE_MYSQL_ERRORS = {1213}


def is_retryable(exc: OperationalError) -> bool:
    """Whether the database rolled the transaction back and it may simply run again."""
    cause = exc.__cause__
    if getattr(cause, "sqlstate", None) in _RETRYABLE_SQLSTATES:
        return True
    return bool(exc.args) and exc.args[0] in _RETRYABLE_MYSQL_ERRORS


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
    fulfilment step, ``@idempotent``) reports its outcome through here.
    """
    message_consumed.send(
        sender=ProcessedMessage,
        consumer=consumer,
        message_id=message_id,
        message_type=message_type,
        order_id=order_id,
        outcome=outcome,
        reason=reason,
    )


def announce(consumer: str, envelope: Envelope, outcome: Outcome, reason: str) -> None:
    """:func:`consumed` for a parsed envelope."""
    consumed(
        consumer,
        envelope.message_id,
        outcome,
        message_type=envelope.message_type,
        order_id=envelope.order_id,
        reason=reason,
    )
