"""The testing kit adopters use (``idempotent_orders.testing``) does what it says: its
storms deliver every copy, its crash points kill a delivery before commit, and its
invariant fails when a message was lost, failed or applied twice."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from django.db import connection

from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import OrderStatus, Outcome, ProcessedMessage
from idempotent_orders.testing import (
    WorkerDied,
    assert_exactly_once,
    crash_at,
    deliver,
    shuffled_copies,
)
from idempotent_orders.testing.kit import ExactlyOnce
from tests.support.messages import payment, shipment


def lifecycle(order: Any) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("payments", payment(order, seq=1)),
        ("shipping", shipment(order, seq=2)),
        ("shipping", shipment(order, "delivered", seq=3)),
    ]


def completed(orders: list[Any]) -> dict[Any, str]:
    return {o.pk: OrderStatus.COMPLETED for o in orders}


def test_shuffled_copies_are_reproducible_and_keep_every_message() -> None:
    messages = [("payments", {"message_id": str(i)}) for i in range(20)]
    storm = shuffled_copies(messages, copies=(1, 4), seed=5)
    assert storm == shuffled_copies(messages, copies=(1, 4), seed=5)
    counts = Counter(m["message_id"] for _, m in storm)
    assert set(counts) == {str(i) for i in range(20)}
    assert set(counts.values()) <= {1, 2, 3, 4}
    assert len(set(counts.values())) > 1
    assert Counter(m["message_id"] for _, m in shuffled_copies(messages, copies=3)) == {
        str(i): 3 for i in range(20)
    }


@pytest.mark.django_db
def test_the_fixture_delivers_a_storm_one_by_one_and_in_batches(
    exactly_once: ExactlyOnce, make_order: Any
) -> None:
    assert isinstance(exactly_once, ExactlyOnce)
    single, batched = [make_order() for _ in range(3)], [make_order() for _ in range(3)]
    for orders, run in ((single, exactly_once.deliver), (batched, exactly_once.deliver_in_batches)):
        messages = [m for o in orders for m in lifecycle(o)]
        storm = exactly_once.shuffled_copies(messages)
        outcomes = run(storm)
        assert sum(outcomes.values()) == len(storm)
        exactly_once.assert_exactly_once(orders, messages, states=completed(orders))


@pytest.mark.django_db(transaction=True)
@pytest.mark.backends("postgresql", "mysql")
def test_the_fixture_delivers_a_storm_from_threads_and_an_event_loop(
    exactly_once: ExactlyOnce, make_order: Any
) -> None:
    for run in (exactly_once.deliver_from_threads, exactly_once.deliver_from_event_loop):
        orders = [make_order() for _ in range(4)]
        messages = [m for o in orders for m in lifecycle(o)]
        storm = exactly_once.shuffled_copies(messages, copies=(2, 4))
        assert sum(run(storm).values()) == len(storm)
        exactly_once.assert_exactly_once(orders, messages, states=completed(orders))


@pytest.mark.parametrize("transactional", [False, True], ids=["in-test-transaction", "commits"])
@pytest.mark.parametrize("point", ["after_inbox_insert", "after_order_update"])
def test_a_crash_writes_nothing_and_the_redelivery_applies_once(
    request: pytest.FixtureRequest, point: str, transactional: bool
) -> None:
    request.getfixturevalue("transactional_db" if transactional else "db")
    make_order = request.getfixturevalue("make_order")
    order = make_order()
    message = payment(order)
    with pytest.raises(WorkerDied, match=point.split("_")[-1]), crash_at(point) as crash:
        consume_message(message, consumer="payments")
    assert crash.fired == 1
    assert not ProcessedMessage.objects.filter(message_id=message["message_id"]).exists()
    assert type(order)._default_manager.get(pk=order.pk).version == 0
    assert connection.is_usable()
    # The broker redelivers: applied once, then a duplicate.
    assert deliver([("payments", message)] * 2) == {Outcome.APPLIED: 1, Outcome.DUPLICATE: 1}
    assert_exactly_once([order], [("payments", message)], states={order.pk: OrderStatus.PAID})


@pytest.mark.django_db
def test_a_crash_point_fires_the_given_number_of_times(make_order: Any) -> None:
    orders = [make_order() for _ in range(3)]
    messages = [("payments", payment(o)) for o in orders]
    died = 0
    with crash_at("after_order_update", times=2) as crash:
        for delivery in messages * 2:
            try:
                deliver([delivery])
            except WorkerDied:
                died += 1
    assert (died, crash.fired) == (2, 2)
    assert_exactly_once(orders, messages)


@pytest.mark.django_db
def test_a_crash_point_never_reached_or_unknown_fails_the_test(make_order: Any) -> None:
    with pytest.raises(ValueError, match="unknown crash point"), crash_at("before_lunch"):
        pass
    with pytest.raises(AssertionError, match="never reached"), crash_at("after_order_update"):
        pass


@pytest.mark.django_db
def test_the_invariant_fails_on_a_lost_a_failed_or_a_doubled_message(make_order: Any) -> None:
    order = make_order()
    pay, ship = payment(order, seq=1), shipment(order, seq=2)
    deliver([("payments", pay)])
    with pytest.raises(AssertionError, match="no inbox row"):
        assert_exactly_once([order], [("payments", pay), ("shipping", ship)])
    with pytest.raises(AssertionError, match="in 'paid', expected 'shipped'"):
        assert_exactly_once([order], [("payments", pay)], states={order.pk: "shipped"})
    ProcessedMessage.objects.filter(message_id=pay["message_id"]).update(status="failed")
    with pytest.raises(AssertionError, match="left failed"):
        assert_exactly_once([order], [("payments", pay)])
    ProcessedMessage.objects.filter(message_id=pay["message_id"]).update(status="done")
    type(order)._default_manager.filter(pk=order.pk).update(version=2)
    with pytest.raises(AssertionError, match=r"version 2, but 0 \+ 1 applied"):
        assert_exactly_once([order], [("payments", pay)])
    assert_exactly_once([order], [("payments", pay)], baseline={order.pk: 1})


def test_the_fixture_is_not_autouse(request: pytest.FixtureRequest) -> None:
    assert "exactly_once" not in request.fixturenames
    assert "db" not in request.fixturenames
