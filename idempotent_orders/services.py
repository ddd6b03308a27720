"""Idempotent writes: consuming a payment or shipping message exactly once."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, OperationalError, transaction
from django.db.models import F

from idempotent_orders import dedup
from idempotent_orders.conf import conf
from idempotent_orders.exceptions import ConcurrentUpdate, InvalidMessage
from idempotent_orders.handlers import MessageHandler, get_handler
from idempotent_orders.models import (
    InboxStatus,
    Order,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.signals import (
    dedup_answered,
    message_consumed,
    message_released,
    parked_overdue,
)
from idempotent_orders.transitions import TransitionStatus, apply_transition, classify

__all__ = [
    "Envelope",
    "Outcome",
    "consume_message",
    "parse_envelope",
    "release_parked",
    "surface_overdue_parked",
]

logger = logging.getLogger("idempotent_orders")

#: Stored excerpt of a rejected message's raw body.
_BODY_EXCERPT = 4096


@dataclass(frozen=True)
class Envelope:
    """A validated message envelope."""

    message_id: str
    message_type: str
    order_id: int
    seq: int | None
    payload: dict[str, Any]
    handler: MessageHandler

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


@dataclass(frozen=True)
class _Decision:
    outcome: Outcome | None  # None: apply the transition
    reason: str = ""


class _Conflict(Exception):
    """The order changed between our read and our conditional write: decide again."""


class _Duplicate(Exception):
    """The inbox already holds this (consumer, message_id)."""


def _has_nul(value: Any, depth: int = 0) -> bool:
    if depth > 32:
        return False  # the size/serialisation check rejects absurd nesting
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, Mapping):
        return any(_has_nul(k, depth + 1) or _has_nul(v, depth + 1) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(v, depth + 1) for v in value)
    return False


def _valid_message_id(value: Any) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= conf.MAX_MESSAGE_ID_LENGTH
        and value.strip() == value
        and value.isprintable()
    )


def _serialise(message: Any) -> str:
    """The message as escaped JSON text (no NUL bytes, no lone surrogates)."""
    try:
        return json.dumps(message, ensure_ascii=True, sort_keys=True, default=repr)
    except (TypeError, ValueError, RecursionError):
        try:
            text = repr(message)[:_BODY_EXCERPT]
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
        size = len(json.dumps(message, ensure_ascii=False).encode("utf-8"))
    except UnicodeEncodeError:
        # A lone surrogate (JSON allows "\ud800") cannot be stored in any database column.
        raise InvalidMessage("message contains an unpaired UTF-16 surrogate") from None
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidMessage(f"message is not JSON-serialisable: {str(exc)[:120]}") from None
    if size > conf.MAX_MESSAGE_BYTES:
        raise InvalidMessage(f"message is {size} bytes, the limit is {conf.MAX_MESSAGE_BYTES}")
    message_id = message.get("message_id")
    if not _valid_message_id(message_id):
        raise InvalidMessage(
            "message_id must be a non-empty printable string of at most "
            f"{conf.MAX_MESSAGE_ID_LENGTH} characters without surrounding spaces"
        )
    if _has_nul(message):
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


def _synthetic_id(message: Any) -> str:
    """A stable inbox id for a message whose own id is unusable, so copies dedup too."""
    digest = hashlib.sha256(_serialise(message).encode("ascii")).hexdigest()
    return f"invalid:{digest}"


def consume_message(message: Any, *, consumer: str) -> Outcome:
    """Apply one payment/shipping message to its order, exactly once.

    Never raises for bad input: a malformed or inapplicable message is recorded
    as ``rejected`` with its reason. Database errors (lost connection,
    serialization failure) propagate so the caller can retry the delivery.
    Parked successors that this message unblocks are released before returning.
    """
    try:
        envelope = parse_envelope(message, consumer=consumer)
    except InvalidMessage as exc:
        raw_id = message.get("message_id") if isinstance(message, Mapping) else None
        message_id = raw_id if _valid_message_id(raw_id) and not _has_nul(raw_id) else None
        message_id = message_id or _synthetic_id(message)
        outcome = _reject(
            consumer=consumer,
            message_id=message_id,
            message_type=_excerpt(message.get("type")) if isinstance(message, Mapping) else "",
            order=None,
            seq=None,
            reason=exc.message,
            body=_serialise(message)[:_BODY_EXCERPT],
        )
        _remember(consumer, message_id)
        return outcome

    if dedup.lookup(consumer, envelope.message_id) is dedup.Layer.REDIS_HIT:
        # Only a Redis key written after the whole message was handled (its
        # transaction and the releases below) answers without the database.
        _announce(consumer, envelope, Outcome.DUPLICATE, "fast path: already processed")
        return Outcome.DUPLICATE

    waiting: list[bool] = []
    outcome = _consume(envelope, consumer, waiting=waiting)
    if outcome is Outcome.PARKED or any(waiting):
        # Every outcome may unblock a successor: an applied message fills a gap,
        # a duplicate may be the redelivery of one whose worker died before
        # releasing, and a parked one re-checks because its predecessor may
        # have committed while it was parking (the lost wake-up). Orders that
        # never had a parked message are skipped: their ``has_parked`` was read
        # false and the write was conditional on it (see _write), so a message
        # parked concurrently either made our write conflict and re-read, or
        # committed after us and re-checks itself.
        release_parked(envelope.order_id)
    # Remembered last: a worker that dies before this point leaves no fast-path
    # key, so the redelivery reaches the database and releases successors itself.
    _remember(consumer, envelope.message_id)
    return outcome


def _remember(consumer: str, message_id: str) -> None:
    transaction.on_commit(lambda: dedup.remember(consumer, message_id))


def _database_conflict(consumer: str, message_id: str) -> None:
    dedup_answered.send(
        sender=dedup.Layer,
        layer=dedup.Layer.DATABASE_CONFLICT,
        consumer=consumer,
        message_id=message_id,
    )


def _excerpt(value: Any) -> str:
    return value[:64] if isinstance(value, str) and "\x00" not in value else ""


def _reject(
    *,
    consumer: str,
    message_id: str,
    message_type: str,
    order: Order | None,
    seq: int | None,
    reason: str,
    body: str,
) -> Outcome:
    try:
        with transaction.atomic():
            ProcessedMessage.objects.create(
                consumer=consumer,
                message_id=message_id,
                message_type=message_type,
                status=InboxStatus.REJECTED,
                outcome=Outcome.REJECTED,
                order=order,
                seq=seq,
                error=reason,
                body=body,
            )
    except IntegrityError:
        outcome, reason = Outcome.DUPLICATE, "already recorded"
        _database_conflict(consumer, message_id)
    else:
        outcome = Outcome.REJECTED
        logger.warning(
            "rejected message %s (%s): %s",
            message_id,
            consumer,
            reason,
            extra={"message_id": message_id, "order_id": order.pk if order else None},
        )
    message_consumed.send(
        sender=ProcessedMessage,
        consumer=consumer,
        message_id=message_id,
        message_type=message_type,
        order_id=order.pk if order else None,
        outcome=outcome,
        reason=reason,
    )
    return outcome


def _announce(consumer: str, envelope: Envelope, outcome: Outcome, reason: str) -> None:
    message_consumed.send(
        sender=ProcessedMessage,
        consumer=consumer,
        message_id=envelope.message_id,
        message_type=envelope.message_type,
        order_id=envelope.order_id,
        outcome=outcome,
        reason=reason,
    )


#: SQLSTATEs / MySQL error numbers after which the transaction was rolled back
#: and may simply run again.
_RETRYABLE_SQLSTATES = {"40001", "40P01"}
_RETRYABLE_MYSQL_ERRORS = {1213}


def _is_deadlock(exc: OperationalError) -> bool:
    cause = exc.__cause__
    if getattr(cause, "sqlstate", None) in _RETRYABLE_SQLSTATES:
        return True
    return bool(exc.args) and exc.args[0] in _RETRYABLE_MYSQL_ERRORS


def _decide(order: Order, envelope: Envelope) -> _Decision:
    """Where this message stands against the order as read: pure, no writes."""
    seq, last = envelope.seq, order.last_seq
    if seq is not None:
        if seq <= last:
            return _Decision(Outcome.STALE, f"seq {seq} is not after the last applied seq {last}")
        if seq > last + 1:
            return _Decision(Outcome.PARKED, f"waiting for seq {last + 1}")
    name = envelope.handler.transition
    status = classify(Order, name, order.status)
    if status is TransitionStatus.APPLIED:
        return _Decision(None)
    if status is TransitionStatus.AT_TARGET:
        return _Decision(Outcome.DUPLICATE, f"order is already {order.status}")
    if status is TransitionStatus.PAST_TARGET:
        return _Decision(Outcome.STALE, f"order has moved past this step (now {order.status})")
    if status is TransitionStatus.LATER:
        return _Decision(Outcome.PARKED, f"order is {order.status}; {name} is not possible yet")
    return _Decision(
        Outcome.REJECTED,
        f"order is {order.status}; {envelope.message_type} can never apply to it",
    )


def _consume(
    envelope: Envelope,
    consumer: str,
    parked: ParkedMessage | None = None,
    *,
    waiting: list[bool] | None = None,
) -> Outcome:
    """Decide and write in one transaction; loop while other writers win the race.

    With ``parked`` set, the message is being released: its inbox row exists
    and is updated rather than inserted, and the parked row is claimed by
    deleting it first. ``waiting`` receives the ``has_parked`` flag of the
    order as last read (nothing when there is no order).
    """
    for _attempt in range(conf.CONFLICT_RETRIES):
        order = Order.objects.filter(pk=envelope.order_id).first()
        if order is not None and waiting is not None:
            waiting[:] = [order.has_parked]
        if order is None:
            if parked is not None:  # the order was deleted; its parked rows went with it
                return Outcome.PARKED
            return _reject(
                consumer=consumer,
                message_id=envelope.message_id,
                message_type=envelope.message_type,
                order=None,
                seq=envelope.seq,
                reason=f"unknown order {envelope.order_id}",
                body=_serialise(envelope.as_dict())[:_BODY_EXCERPT],
            )
        try:
            fields = envelope.handler.validate(order, envelope.payload)
        except InvalidMessage as exc:
            fields = {}
            if envelope.seq is not None and envelope.seq > order.last_seq + 1:
                # Rejected in its turn, so that it still fills its sequence slot.
                decision = _decide(order, envelope)
            else:
                decision = _Decision(Outcome.REJECTED, exc.message)
        else:
            decision = _decide(order, envelope)
        if parked is not None and decision.outcome is Outcome.PARKED:
            return Outcome.PARKED  # still waiting; leave the parked row alone
        try:
            outcome = _write(envelope, consumer, order, decision, fields, parked)
        except _Duplicate:
            if parked is None:
                _database_conflict(consumer, envelope.message_id)
                _announce(consumer, envelope, Outcome.DUPLICATE, "already in the inbox")
            return Outcome.DUPLICATE
        except _Conflict:
            continue
        except OperationalError as exc:
            if not _is_deadlock(exc):
                raise
            # The database rolled the whole transaction back (on MariaDB the inbox
            # row's foreign-key lock and the order UPDATE can cross); run it again.
            continue
        if parked is not None:
            message_released.send(
                sender=ParkedMessage,
                consumer=consumer,
                message_id=envelope.message_id,
                order_id=envelope.order_id,
                outcome=outcome,
            )
        _announce(consumer, envelope, outcome, decision.reason)
        return outcome
    raise ConcurrentUpdate(
        f"order {envelope.order_id}: gave up after {conf.CONFLICT_RETRIES} conflicting writes"
    )


def _write(
    envelope: Envelope,
    consumer: str,
    order: Order,
    decision: _Decision,
    fields: dict[str, Any],
    parked: ParkedMessage | None,
) -> Outcome:
    outcome = decision.outcome or Outcome.APPLIED
    in_sequence = envelope.seq is not None and envelope.seq == order.last_seq + 1
    # A write that may unblock a successor is conditional on the has_parked
    # flag as read, so a message parked since our read makes it conflict.
    unflagged: dict[str, Any] = {} if order.has_parked else {"has_parked": False}
    with transaction.atomic():
        # The first statement claims the message: the inbox insert (the unique
        # index decides duplicates), or for a release, deleting the parked row.
        if parked is None:
            try:
                with transaction.atomic(savepoint=False):
                    ProcessedMessage.objects.create(
                        consumer=consumer,
                        message_id=envelope.message_id,
                        message_type=envelope.message_type,
                        status=(
                            InboxStatus.REJECTED
                            if outcome is Outcome.REJECTED
                            else InboxStatus.DONE
                        ),
                        outcome=outcome,
                        order=order,
                        seq=envelope.seq,
                        error=decision.reason,
                        body=(
                            _serialise(envelope.as_dict())[:_BODY_EXCERPT]
                            if outcome is Outcome.REJECTED
                            else ""
                        ),
                    )
            except IntegrityError:
                raise _Duplicate from None
        else:
            claimed, _ = ParkedMessage.objects.filter(pk=parked.pk).delete()
            if not claimed:
                raise _Duplicate  # another worker released it
            ProcessedMessage.objects.filter(
                consumer=consumer, message_id=envelope.message_id
            ).update(
                outcome=outcome,
                status=InboxStatus.REJECTED if outcome is Outcome.REJECTED else InboxStatus.DONE,
                error=decision.reason,
                attempts=F("attempts") + 1,
            )

        if decision.outcome is None:
            extra: dict[str, Any] = dict(unflagged)
            if envelope.seq is not None:
                fields = {**fields, "last_seq": envelope.seq}
                extra["last_seq"] = envelope.seq - 1
            result = apply_transition(
                order, envelope.handler.transition, fields=fields, extra_filters=extra
            )
            if not result.applied:
                raise _Conflict
        elif outcome is Outcome.PARKED:
            try:
                with transaction.atomic():
                    ParkedMessage.objects.create(
                        consumer=consumer,
                        message_id=envelope.message_id,
                        order=order,
                        seq=envelope.seq,
                        envelope=envelope.as_dict(),
                        reason=decision.reason[:255],
                    )
            except IntegrityError:
                # Another message already waits with this (order, seq): a producer bug.
                ProcessedMessage.objects.filter(
                    consumer=consumer, message_id=envelope.message_id
                ).update(
                    outcome=Outcome.REJECTED,
                    status=InboxStatus.REJECTED,
                    error=f"another message is already parked with seq {envelope.seq}",
                )
                outcome = Outcome.REJECTED
            else:
                if not order.has_parked:
                    # In the parking transaction, so that a predecessor's
                    # conditional write either sees it or commits before it.
                    Order.objects.filter(pk=order.pk).update(has_parked=True)
        elif in_sequence:
            # The message used up its sequence slot without changing the state:
            # advance last_seq so its successors are not parked forever.
            advanced = Order.objects.filter(
                pk=order.pk, last_seq=order.last_seq, **unflagged
            ).update(last_seq=envelope.seq)
            if advanced != 1:
                raise _Conflict
    return outcome


def release_parked(order_id: int) -> list[Outcome]:
    """Decide again every parked message of an order that can now go ahead, in order.

    Each release runs in its own transaction; a message still waiting stays
    parked. Safe to call from several workers at once: a parked row is claimed
    by deleting it, so only one of them releases it.
    """
    outcomes: list[Outcome] = []
    progressed = True
    while progressed:
        progressed = False
        waiting = list(ParkedMessage.objects.filter(order_id=order_id).order_by("seq", "id"))
        for parked in waiting:
            try:
                envelope = parse_envelope(parked.envelope, consumer=parked.consumer)
            except InvalidMessage as exc:  # a handler was unregistered meanwhile
                envelope = None
                reason = exc.message
            if envelope is None:
                with transaction.atomic():
                    if ParkedMessage.objects.filter(pk=parked.pk).delete()[0]:
                        ProcessedMessage.objects.filter(
                            consumer=parked.consumer, message_id=parked.message_id
                        ).update(
                            outcome=Outcome.REJECTED, status=InboxStatus.REJECTED, error=reason
                        )
                continue
            outcome = _consume(envelope, parked.consumer, parked=parked)
            if outcome is not Outcome.PARKED:
                outcomes.append(outcome)
                progressed = True
                break  # the order changed: read the waiting list again, in order
    return outcomes


def surface_overdue_parked(*, timeout: int | None = None) -> list[ParkedMessage]:
    """Release what can go ahead, then mark parked messages older than ``timeout`` overdue.

    The release pass is a backstop for a worker that died between parking a
    message and re-checking it. Each message is marked once (a conditional
    UPDATE), and ``parked_overdue`` is sent for it; operators find the rows in
    the admin under "overdue". Returns the newly marked rows.
    """
    from django.utils import timezone

    timeout = conf.PARKED_TIMEOUT if timeout is None else timeout
    now = timezone.now()
    cutoff = now - timedelta(seconds=timeout)
    old = ParkedMessage.objects.filter(parked_at__lte=cutoff, overdue_at__isnull=True)
    for order_id in old.values_list("order_id", flat=True).distinct().order_by("order_id"):
        release_parked(order_id)
    marked: list[ParkedMessage] = []
    for parked in old.order_by("order_id", "seq", "id"):
        if ParkedMessage.objects.filter(pk=parked.pk, overdue_at__isnull=True).update(
            overdue_at=now
        ):
            parked.overdue_at = now
            marked.append(parked)
            waited = (now - parked.parked_at).total_seconds()
            logger.error(
                "parked message %s of order %s waited %.0fs for its predecessor: %s",
                parked.message_id,
                parked.order_id,
                waited,
                parked.reason,
                extra={"message_id": parked.message_id, "order_id": parked.order_id},
            )
            parked_overdue.send(sender=ParkedMessage, parked=parked, waited=waited)
    return marked


def order_business_key(
    *,
    customer: Any,
    items: list[dict[str, Any]],
    window: int,
    at: float,
    anonymous_id: str = "",
) -> str:
    """SHA-256 of customer, the normalised items and the time window ``at`` falls in.

    Items are merged by SKU and sorted, so the same basket typed in another
    order is the same business order. Two requests on either side of a window
    boundary get different keys (the price of a stateless key; documented).
    """
    basket: dict[str, int] = {}
    for item in items:
        basket[str(item["sku"])] = basket.get(str(item["sku"]), 0) + int(item["quantity"])
    owner = f"user:{customer.pk}" if customer is not None else f"anon:{anonymous_id}"
    slot = int(at // window)
    raw = json.dumps([owner, sorted(basket.items()), slot], separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()


def create_order(
    *,
    customer: Any,
    items: list[dict[str, Any]],
    amount: Any,
    currency: str,
    window: int | None = None,
    anonymous_id: str = "",
    at: float | None = None,
) -> tuple[Order, bool]:
    """The order for this customer's basket in the current time window: ``(order, created)``.

    Concurrent callers race on the unique ``business_key`` index; the loser's
    insert fails and it reads the winner's row, so every caller gets the one
    order. ``anonymous_id`` (e.g. the session key) separates anonymous customers.
    """
    if not items:
        raise ValueError("an order needs at least one item")
    key = order_business_key(
        customer=customer,
        items=items,
        window=window or conf.ORDER_WINDOW,
        at=time.time() if at is None else at,
        anonymous_id=anonymous_id,
    )
    existing = Order.objects.filter(business_key=key).first()
    if existing is not None:
        return existing, False
    try:
        with transaction.atomic():
            order = Order.objects.create(
                business_key=key, customer=customer, amount=amount, currency=currency
            )
    except IntegrityError:
        # A concurrent caller won the insert. A locking read sees its committed
        # row even inside a REPEATABLE READ snapshot taken before the race.
        with transaction.atomic():
            return Order.objects.select_for_update().get(business_key=key), False
    return order, True
