"""The consume road from an event loop: ``aconsume_message`` and ``aconsume_batch``.

Each message still runs in its own transaction, on a worker thread with its own
connection; a storm of duplicated, shuffled deliveries gathered on one loop applies
every message once and ends where consuming one by one ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import date, datetime
from typing import Any

import pytest
from django.db.models import DateTimeField
from django_fsm.signals import post_transition

from idempotent_orders import get_order_model
from idempotent_orders.consuming import MessageFailed, aconsume_batch, aconsume_message
from idempotent_orders.models import InboxStatus, OrderStatus, Outcome, ProcessedMessage
from idempotent_orders.testing import assert_exactly_once, deliver, shuffled_copies
from tests.support.messages import payment, shipment

pytestmark = pytest.mark.django_db(transaction=True)


def end_state(order: Any) -> dict[str, Any]:
    """Every column but the key, the business key, timestamps and ``has_parked`` (a hint
    that stays set once a message parked on the order, which only a storm may do); the
    order's pk in a value (``pay-<pk>``, ``TRK<pk>``) written as ``<pk>``."""
    fresh = type(order)._default_manager.get(pk=order.pk)
    state: dict[str, Any] = {}
    for f in type(order)._meta.concrete_fields:
        if (
            f.primary_key
            or f.name in ("business_key", "has_parked")
            or isinstance(f, DateTimeField)
        ):
            continue
        value = getattr(fresh, f.attname)
        if isinstance(value, datetime | date):
            continue
        if isinstance(value, str):
            value = value.replace(str(order.pk), "<pk>")
        state[f.name] = value
    return state


def lifecycle(order: Any) -> list[tuple[str, dict[str, Any]]]:
    """The order's payment, dispatch and delivery (seq 1-3), as its producers send them."""
    return [
        ("payments", payment(order, message_id=f"p-{order.pk}", seq=1)),
        ("shipping", shipment(order, message_id=f"d-{order.pk}", seq=2)),
        ("shipping", shipment(order, "delivered", message_id=f"c-{order.pk}", seq=3)),
    ]


@pytest.mark.backends("postgresql", "mysql")
def test_a_storm_from_an_event_loop_applies_each_message_once(make_order: Any) -> None:
    orders = [make_order() for _ in range(6)]
    messages = [m for o in orders for m in lifecycle(o)]
    storm = shuffled_copies(messages, copies=(2, 5), seed=7)

    async def gather() -> list[Outcome]:
        return await asyncio.gather(*(aconsume_message(m, consumer=c) for c, m in storm))

    outcomes = asyncio.run(gather())

    assert len(outcomes) == len(storm)
    assert Outcome.FAILED not in outcomes
    assert outcomes.count(Outcome.APPLIED) <= len(messages)
    assert_exactly_once(orders, messages, states={o.pk: OrderStatus.COMPLETED for o in orders})
    # The same messages consumed once each, in order, on fresh orders, end the same.
    reference = [make_order() for _ in orders]
    assert set(deliver(m for o in reference for m in lifecycle(o))) == {Outcome.APPLIED}
    assert [end_state(o) for o in orders] == [end_state(o) for o in reference]


def test_a_batch_from_an_event_loop(make_order: Any) -> None:
    orders = [make_order() for _ in range(3)]
    messages = [payment(o) for o in orders]
    outcomes = asyncio.run(aconsume_batch([*messages, messages[0]], consumer="payments"))
    assert outcomes == [Outcome.APPLIED] * 3 + [Outcome.DUPLICATE]
    again = asyncio.run(aconsume_batch(messages, consumer="payments"))
    assert again == [Outcome.DUPLICATE] * 3
    assert_exactly_once(orders, [("payments", m) for m in messages])


def test_the_thread_sensitive_road_gives_the_same_outcomes(make_order: Any) -> None:
    order = make_order()
    pay, ship = payment(order, seq=1), shipment(order, seq=2)

    async def run() -> list[Outcome]:
        first = await aconsume_message(ship, consumer="shipping", thread_sensitive=True)
        second = await aconsume_message(pay, consumer="payments", thread_sensitive=True)
        third = await aconsume_message(pay, consumer="payments")
        return [first, second, third]

    assert asyncio.run(run()) == [Outcome.PARKED, Outcome.APPLIED, Outcome.DUPLICATE]
    assert_exactly_once(
        [order],
        [("payments", pay), ("shipping", ship)],
        states={order.pk: OrderStatus.SHIPPED},
    )


class Broken:
    def __call__(self, sender: Any, **kwargs: Any) -> None:
        raise ZeroDivisionError("a bug in a receiver")


@pytest.fixture
def broken_receiver() -> Iterator[Broken]:
    receiver = Broken()
    post_transition.connect(receiver, sender=get_order_model(), weak=False)
    yield receiver
    post_transition.disconnect(receiver, sender=get_order_model())


def test_a_failing_message_raises_message_failed_in_async_too(
    make_order: Any, broken_receiver: Broken
) -> None:
    order = make_order()
    message = payment(order)
    with pytest.raises(MessageFailed) as raised:
        asyncio.run(aconsume_message(message, consumer="payments"))
    assert isinstance(raised.value.__cause__, ZeroDivisionError)
    row = ProcessedMessage.objects.get(consumer="payments", message_id=message["message_id"])
    assert (row.status, row.attempts) == (InboxStatus.FAILED, 1)
    assert get_order_model()._default_manager.get(pk=order.pk).version == 0
    # A batch keeps the failed message and goes on (as consume_batch does).
    assert asyncio.run(aconsume_batch([message], consumer="payments")) == [Outcome.FAILED]
    assert ProcessedMessage.objects.get(pk=row.pk).attempts == 2


def test_the_storm_check_fails_when_a_message_applies_twice(make_order: Any) -> None:
    """The invariant the storm test relies on catches a second application."""
    order = make_order()
    message = payment(order)
    assert asyncio.run(aconsume_message(message, consumer="payments")) is Outcome.APPLIED
    type(order)._default_manager.filter(pk=order.pk).update(version=2)  # a second write
    with pytest.raises(AssertionError, match="version 2, but 0 \\+ 1 applied"):
        assert_exactly_once([order], [("payments", message)])
