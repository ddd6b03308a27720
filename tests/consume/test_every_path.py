"""The guarantee on the side roads: batch gaps, fast-path keys, follow-ups in the outbox."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.db import transaction
from django.test import override_settings

from idempotent_orders.consuming import batch as batch_module
from idempotent_orders.consuming import single
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import (
    Order,
    OrderStatus,
    OutboxMessage,
    OutboxStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)
from tests.support.messages import payment, shipment
from tests.support.services import require_service


class Crash(Exception):
    """The worker dies here; the broker delivers the message again."""


def _crash(*args: Any, **kwargs: Any) -> Any:
    raise Crash


def _one(path: str, message: dict[str, Any], consumer: str) -> Outcome:
    if path == "batch":
        (outcome,) = consume_batch([message], consumer=consumer)
        return outcome
    return consume_message(message, consumer=consumer)


def _stream(order: Order) -> list[dict[str, Any]]:
    """seq 1 pays, seq 2 is a dispatch with no tracking number (invalid), seq 3 dispatches."""
    return [
        payment(order, seq=1),
        shipment(order, seq=2, tracking_number=""),
        shipment(order, seq=3),
    ]


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["single", "batch"])
def test_an_invalid_early_message_is_rejected_in_its_turn_and_fills_its_gap(
    make_order, path
) -> None:
    order = make_order()
    first, invalid, third = _stream(order)
    if path == "batch":
        assert consume_batch([invalid, third], consumer="shipping") == [
            Outcome.PARKED,
            Outcome.PARKED,
        ]
        assert consume_batch([first], consumer="payments") == [Outcome.APPLIED]
    else:
        assert consume_message(invalid, consumer="shipping") is Outcome.PARKED
        assert consume_message(third, consumer="shipping") is Outcome.PARKED
        assert consume_message(first, consumer="payments") is Outcome.APPLIED
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.last_seq, row.version) == (OrderStatus.SHIPPED, 3, 2)
    assert not ParkedMessage.objects.exists()
    rejected = ProcessedMessage.objects.get(message_id=invalid["message_id"])
    assert rejected.outcome == Outcome.REJECTED
    assert "tracking_number" in rejected.error


@pytest.mark.django_db(transaction=True)
def test_a_redelivery_after_a_crash_before_release_releases_the_successor(make_order) -> None:
    """Killed between commit and release: the fast path must not answer the redelivery."""
    require_service("redis", settings.REDIS_URL)
    order = make_order()
    pay, ship = payment(order, seq=1), shipment(order, seq=2)
    assert consume_message(ship, consumer="shipping") is Outcome.PARKED
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(single, "release_parked", _crash)
        with pytest.raises(Crash):
            consume_message(pay, consumer="payments")
    assert ParkedMessage.objects.filter(order=order).exists()  # the crash left it parked
    assert consume_message(pay, consumer="payments") is Outcome.DUPLICATE
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.last_seq) == (OrderStatus.SHIPPED, 2)
    assert not ParkedMessage.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_batch_releases_what_it_unblocks_in_its_own_transaction(make_order) -> None:
    """No moment between commit and release: a crash after commit leaves nothing parked."""
    require_service("redis", settings.REDIS_URL)
    order = make_order()
    pay, ship = payment(order, seq=1), shipment(order, seq=2)
    assert consume_message(ship, consumer="shipping") is Outcome.PARKED
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batch_module, "release_parked", _crash)
        assert consume_batch([pay], consumer="payments") == [Outcome.APPLIED]
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.last_seq, row.version) == (OrderStatus.SHIPPED, 2, 2)
    assert not ParkedMessage.objects.exists()
    assert ProcessedMessage.objects.get(message_id=ship["message_id"]).outcome == Outcome.APPLIED
    assert consume_batch([pay], consumer="payments") == [Outcome.DUPLICATE]


def _fulfil_after_payment() -> override_settings:
    return override_settings(
        IDEMPOTENT_ORDERS={
            **settings.IDEMPOTENT_ORDERS,
            "FULFIL_AFTER_PAYMENT": True,
            "OUTBOX_PUBLISH_ON_COMMIT": False,
        }
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["single", "batch"])
def test_the_fulfilment_follow_up_is_written_in_the_payments_transaction(make_order, path) -> None:
    order = make_order()
    with _fulfil_after_payment():
        assert _one(path, payment(order), "payments") is Outcome.APPLIED
    row = OutboxMessage.objects.get(message_id=f"fulfil-{order.pk}")
    assert row.task_name == "idempotent_orders.fulfil_order"
    assert row.payload == order.pk
    assert row.status == OutboxStatus.PENDING


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_payment_leaves_no_follow_up(make_order) -> None:
    order = make_order()
    seen_in_transaction = []

    def pay_then_fail() -> None:
        with transaction.atomic():
            assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
            seen_in_transaction.append(
                OutboxMessage.objects.filter(message_id=f"fulfil-{order.pk}").exists()
            )
            raise Crash

    with _fulfil_after_payment(), pytest.raises(Crash):
        pay_then_fail()
    assert seen_in_transaction == [True]
    assert not OutboxMessage.objects.exists()
    assert Order.objects.get(pk=order.pk).status == OrderStatus.PENDING_PAYMENT
