"""Durable timers: a transition an order takes at a time, unless it moved on first.

A timer is a row (:class:`~idempotent_orders.models.Timer`) written in the
transaction that put the order in the state it waits on, so it exists exactly
when that state was committed; no in-memory ETA is lost with a worker.
:func:`fire_due` (the ``idempotent_orders.fire_due_timers`` task, on beat)
consumes each due timer's message through
:func:`~idempotent_orders.consuming.single.consume_message` with the message id fixed
when the timer was written: two beats, two workers or a retry firing the same
timer are duplicates in the inbox, and a payment racing the timer ends in one
outcome (paid, or expired with the payment rejected as money to give back).

``PAYMENT_TIMEOUT`` schedules ``PAYMENT_TIMEOUT_TRANSITION`` for every order
created in a state that transition leaves; :func:`schedule` is the general form.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Model, Q
from django.utils import timezone

from idempotent_orders import get_order_model, otel, tracing
from idempotent_orders.conf import conf
from idempotent_orders.consuming import registry
from idempotent_orders.consuming.failures import TRANSIENT, MessageFailed, dead_letter, describe
from idempotent_orders.consuming.graph import (
    TransitionStatus,
    classify,
    current_state,
    has_transition,
)
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import Outcome, ProcessedMessage, Timer, TimerStatus

__all__ = ["CONSUMER", "fire_due", "schedule", "timer_message_id"]

logger = logging.getLogger("idempotent_orders")

#: The consumer timers' messages are consumed as (their inbox rows say so).
CONSUMER = "timers"


def message_type(transition: str) -> str:
    """The message type a timer of ``transition`` sends, bound for the ``timers`` consumer."""
    return f"timer.{transition}"[:64]


def _bind(transition: str) -> str:
    name = message_type(transition)
    handler = registry.get_handler(name)
    if handler is None or handler.transition != transition:
        registry.register(name, transition=transition, consumers={CONSUMER})
    return name


def timer_message_id(order: Model, transition: str, key: str = "") -> str:
    """The fixed message id of ``order``'s timer for ``transition`` (and ``key``)."""
    base = f"timer:{order._meta.label_lower}:{order.pk}:{transition}"
    return f"{base}:{key}" if key else base


def schedule(
    order: Model,
    transition: str,
    *,
    at: datetime,
    key: str = "",
    payload: dict[str, Any] | None = None,
) -> Timer:
    """Make ``order`` take ``transition`` at ``at`` unless it has moved on by then.

    Call it in the transaction that puts the order in the state the timer waits
    on (a ``post_transition`` receiver, or where the order is created): the
    timer commits, or rolls back, with that state. Scheduling the same
    (order, transition, ``key``) again returns the timer already written; pass
    a new ``key`` (e.g. the order's version) for an order that waits in that
    state a second time. ``payload`` entries are passed to the transition as a
    message's would be.

    Refused at once, with :class:`ValueError` (:class:`TypeError` for an ``at``
    that is not a datetime): a ``transition`` the order model does not declare,
    and a naive ``at`` (the time zone is not guessed). An ``at`` in the past is
    accepted: the timer is due, and the next pass of :func:`fire_due` fires it.
    """
    model = type(order)
    if not isinstance(at, datetime):
        raise TypeError(f"at must be a datetime, got {type(at).__name__}")
    if timezone.is_naive(at):
        raise ValueError(
            f"at={at.isoformat()} is naive: pass an aware datetime (timezone.now() + ...)"
        )
    if not isinstance(transition, str) or not has_transition(model, transition):
        raise ValueError(
            f"{model.__name__} declares no transition {transition!r}: a timer of it could "
            "never fire"
        )
    if not transaction.get_connection().in_atomic_block:
        logger.warning(
            "timer for order %s scheduled outside a transaction: it does not commit "
            "with the order's state",
            order.pk,
        )
    message_id = timer_message_id(order, transition, key)
    try:
        with transaction.atomic():
            return Timer.objects.create(
                order_id=order.pk,
                transition=transition,
                message_type=_bind(transition),
                message_id=message_id,
                payload=payload or {},
                due_at=at,
                traceparent=tracing.current().traceparent,
            )
    except IntegrityError:
        return Timer.objects.get(message_id=message_id)


def _claim(timer: Timer, now: datetime) -> bool:
    """Hold ``timer`` for this pass; False when another process holds or fired it."""
    free = Q(claimed_until__isnull=True) | Q(claimed_until__lt=now)
    claimed = Timer.objects.filter(
        free, pk=timer.pk, status__in=[TimerStatus.PENDING, TimerStatus.FAILED]
    ).update(claimed_until=now + timedelta(seconds=conf.TIMER_CLAIM_SECONDS))
    return claimed == 1


def _still_possible(timer: Timer) -> str:
    """Why the timer's transition can no longer apply to its order ("" when it may)."""
    model = get_order_model()
    order = model._default_manager.filter(pk=timer.order_id).first()
    if order is None:
        return "the order is gone"
    state = current_state(order)
    status = classify(model, timer.transition, state)
    if status in (TransitionStatus.APPLIED, TransitionStatus.LATER):
        return ""
    return f"order is {state}; {timer.transition} no longer applies"


@otel.traced_fire
def fire(timer: Timer) -> Outcome:
    """Consume ``timer``'s message (once, whoever calls) and record what it did."""
    consumed = _first_outcome(timer)
    if consumed is not None:
        # Another process fired it first: keep what the first firing decided.
        return _record_consumed(timer, consumed)
    moved_on = _still_possible(timer)
    if moved_on:
        # The order left the state the timer waited on: nothing to send.
        _record(timer, TimerStatus.FIRED, Outcome.STALE, moved_on)
        return Outcome.STALE
    message = {
        "message_id": timer.message_id,
        "type": _bind(timer.transition),
        "order_id": timer.order_id,
        "payload": timer.payload or {},
    }
    try:
        outcome = consume_message(message, consumer=CONSUMER)
    except MessageFailed as exc:
        _record(timer, TimerStatus.FAILED, Outcome.FAILED, exc.reason)
        if timer.attempts + 1 >= conf.TASK_MAX_RETRIES:
            dead_letter(CONSUMER, timer.message_id)  # kept as failed; an operator requeues it
        return Outcome.FAILED
    if outcome is Outcome.DUPLICATE:
        outcome = _first_outcome(timer) or outcome
    return _record_consumed(timer, outcome)


def _record_consumed(timer: Timer, outcome: Outcome) -> Outcome:
    """Record what consuming the timer's message decided, each time with its reason.

    The order may move on between the check in :func:`fire` and the consume (a
    payment wins the race): the inbox then rejects the timer's transition, and the
    timer is recorded ``stale`` with why, as when the check saw it first.
    """
    reason = _inbox_error(timer)
    if outcome in (Outcome.REJECTED, Outcome.STALE):
        moved_on = _still_possible(timer)
        if moved_on:
            _record(timer, TimerStatus.FIRED, Outcome.STALE, moved_on)
            return Outcome.STALE
        reason = reason or f"the {CONSUMER} consumer decided {outcome.value} without a reason"
    _record(timer, TimerStatus.FIRED, outcome, reason)
    return outcome


def _first_outcome(timer: Timer) -> Outcome | None:
    """What consuming the timer's message decided, if it was consumed (and not failed)."""
    first = (
        ProcessedMessage.objects.filter(consumer=CONSUMER, message_id=timer.message_id)
        .exclude(outcome__in=["", Outcome.FAILED])
        .values_list("outcome", flat=True)
        .first()
    )
    return Outcome(first) if first else None


def _inbox_error(timer: Timer) -> str:
    """Why the inbox decided what it did for the timer's message ("" when it says nothing)."""
    error = (
        ProcessedMessage.objects.filter(consumer=CONSUMER, message_id=timer.message_id)
        .values_list("error", flat=True)
        .first()
    )
    return str(error or "")


def _record(timer: Timer, status: str, outcome: Outcome, error: str) -> None:
    # A fired timer keeps its first record (a stale second firing never overwrites it).
    Timer.objects.filter(pk=timer.pk).exclude(status=TimerStatus.FIRED).update(
        status=status,
        outcome=outcome.value,
        error=error[:2000],
        fired_at=timezone.now(),
        claimed_until=None,
    )
    Timer.objects.filter(pk=timer.pk).update(attempts=timer.attempts + 1)


def fire_due(
    *, now: datetime | None = None, limit: int | None = None
) -> list[tuple[Timer, Outcome]]:
    """Fire up to ``limit`` (``TIMER_BATCH_SIZE``) timers due at ``now``; each with its outcome.

    Safe to run in several processes at once: a timer is claimed for
    ``TIMER_CLAIM_SECONDS`` (others skip it), and should two fire it anyway,
    the inbox applies it once. A failed timer is fired again on later passes, at
    most ``TASK_MAX_RETRIES`` times (then its inbox row is a dead letter).
    """
    now = now or timezone.now()
    due = list(
        Timer.objects.filter(
            Q(status=TimerStatus.PENDING)
            | Q(status=TimerStatus.FAILED, attempts__lt=conf.TASK_MAX_RETRIES),
            due_at__lte=now,
        ).order_by("due_at", "id")[: limit or conf.TIMER_BATCH_SIZE]
    )
    done: list[tuple[Timer, Outcome]] = []
    for timer in due:
        if not _claim(timer, now):
            continue
        try:
            done.append((timer, fire(timer)))
        except TRANSIENT:
            Timer.objects.filter(pk=timer.pk).update(claimed_until=None)
            raise
        except Exception as exc:  # a bug around the consume road: keep the timer, say why
            _record(timer, TimerStatus.FAILED, Outcome.FAILED, describe(exc))
            done.append((timer, Outcome.FAILED))
    return done


def schedule_payment_timeout(
    sender: type[Model], instance: Model, created: bool, raw: bool = False, **kwargs: Any
) -> None:
    """``post_save`` of the order model: a new order waiting for payment gets its expiry timer.

    It runs in the transaction that creates the order (``create_order`` opens one;
    so should a project that creates orders itself).
    """
    if not created or raw or conf.PAYMENT_TIMEOUT <= 0:
        return
    name = conf.PAYMENT_TIMEOUT_TRANSITION
    try:
        status = classify(type(instance), name, current_state(instance))
    except Exception:  # no such transition: check E052 says so
        return
    if status is not TransitionStatus.APPLIED:
        return
    schedule(
        instance,
        name,
        at=timezone.now() + timedelta(seconds=conf.PAYMENT_TIMEOUT),
        key="payment",
    )
