"""django-SHOP's order workflow, driven by messages, ends as the shop's own calls do.

Its ``save()`` runs the "auto" transitions (``acknowledge_prepayment`` after a full
prepayment, ``prepare_for_delivery`` after ``ship_goods``); ``acknowledge_payment`` and
``cancel_order`` start from any state (``'*'``: the graph has cycles); payments arrive in
parts. Messages (3 copies each, shuffled, no ``seq``) through ``consume_message`` and
``consume_batch`` must leave the order where the shop's own calls in causal order leave
it, with no receiver or workaround added.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from idempotent_orders.consuming import registry
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.graph import TransitionStatus, classify
from idempotent_orders.consuming.running import road
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.exceptions import InvalidMessage
from idempotent_orders.models import Outcome, ProcessedMessage
from tests.djshop.models import Order, OrderPayment

pytestmark = pytest.mark.django_db(transaction=True)

TOTAL = Decimal("30.00")


def validate_part_payment(order: Any, payload: Any) -> dict[str, Any]:
    """A part of the order's total (django-SHOP takes forward fund payments in parts)."""
    if not isinstance(payload.get("payment_id"), str) or not payload["payment_id"]:
        raise InvalidMessage("payload.payment_id must be a non-empty string")
    if not isinstance(payload.get("amount"), str):
        raise InvalidMessage("payload.amount must be a decimal string")
    return {}


@pytest.fixture(autouse=True)
def message_types() -> Iterator[None]:
    saved = dict(registry._registry)
    registry.register(
        "payment.received",
        transition="receive_payment",
        validate=validate_part_payment,
        money=True,
    )
    registry.register("warehouse.picked", transition="pick_goods")
    registry.register("warehouse.packed", transition="pack_goods")
    registry.register("shipment.dispatched", transition="ship_goods")
    registry.register("order.cancelled", transition="cancel_order")
    yield
    registry._registry.clear()
    registry._registry.update(saved)


def checked_out() -> Order:
    """An order as django-SHOP's checkout leaves it: created from the cart, awaiting payment."""
    order = Order.objects.create(
        business_key=uuid.uuid4().hex, amount=TOTAL, currency="EUR", _subtotal=TOTAL, _total=TOTAL
    )
    order.populate_from_cart()
    order.save()
    order.awaiting_payment()
    order.save()
    return Order.objects.get(pk=order.pk)


def events(order: Order) -> list[dict[str, Any]]:
    """Two part payments, then the warehouse's three steps, as messages."""
    payload = [
        ("payment.received", {"payment_id": f"pi-a-{order.pk}", "amount": "12.00"}),
        ("payment.received", {"payment_id": f"pi-b-{order.pk}", "amount": "18.00"}),
        ("warehouse.picked", {}),
        ("warehouse.packed", {}),
        ("shipment.dispatched", {}),
    ]
    return [
        {"message_id": f"{order.pk}-{n}", "type": kind, "order_id": order.pk, "payload": body}
        for n, (kind, body) in enumerate(payload)
    ]


def plain(order: Order) -> None:
    """The shop's own code for the same events, in causal order: call, then save()."""
    order.receive_payment(payment_id=f"pi-a-{order.pk}", amount="12.00")
    order.save()
    order.receive_payment(payment_id=f"pi-b-{order.pk}", amount="18.00")
    order.save()
    for step in ("pick_goods", "pack_goods", "ship_goods"):
        order = Order.objects.get(pk=order.pk)
        getattr(order, step)()
        order.save()


def outcome_of(order: Order) -> tuple[Any, ...]:
    order.refresh_from_db()
    paid = sorted(
        str(a) for a in OrderPayment.objects.filter(order=order).values_list("amount", flat=True)
    )
    return order.status, order.hooks, paid


def test_the_workflow_takes_the_save_road() -> None:
    name, why = road(Order, "pick_goods")
    assert name == "save"
    assert "save() override in tests.djshop.models.Order" in why


def test_a_step_that_may_come_round_again_is_not_stale() -> None:
    # '*' sources make the graph cyclic: from payment_confirmed an order may reach
    # pick_goods again, so a "packed" arriving there waits instead of being "moved past".
    assert classify(Order, "pack_goods", "payment_confirmed") is TransitionStatus.LATER
    assert classify(Order, "pack_goods", "awaiting_payment") is TransitionStatus.LATER


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("way", ["single", "batch"])
def test_shuffled_copies_end_as_the_shops_own_calls(seed: int, way: str) -> None:
    reference = checked_out()
    plain(reference)
    expected = outcome_of(reference)
    # The save()-driven auto transitions ran: past ship_goods to ready_for_delivery.
    assert expected == ("ready_for_delivery", "", ["12.00", "18.00"])

    order = checked_out()
    deliveries = [m for m in events(order) for _ in range(3)]
    random.Random(seed).shuffle(deliveries)
    if way == "single":
        outcomes = [consume_message(m, consumer="shop") for m in deliveries]
    else:
        outcomes = []
        for start in range(0, len(deliveries), 5):
            outcomes += consume_batch(deliveries[start : start + 5], consumer="shop")
    assert Outcome.FAILED not in outcomes
    assert Outcome.REJECTED not in outcomes
    assert Outcome.STALE not in outcomes
    assert outcome_of(order) == expected
    rows = ProcessedMessage.objects.filter(order_id=order.pk, consumer="shop")
    assert sorted(rows.values_list("outcome", flat=True)) == [Outcome.APPLIED] * 5


def test_cancel_from_anywhere_refunds_what_was_paid() -> None:
    other = checked_out()
    first = events(other)[0]
    assert consume_message(first, consumer="shop") is Outcome.APPLIED
    cancel = {"message_id": f"{other.pk}-cancel", "type": "order.cancelled", "order_id": other.pk}
    assert consume_message(cancel, consumer="shop") is Outcome.APPLIED
    assert outcome_of(other) == ("refund_payment", "withdraw;refund;", ["12.00"])


def test_a_cancel_while_picking_waits_for_a_cancelable_state() -> None:
    order = checked_out()
    messages = events(order)
    for message in messages[:3]:
        assert consume_message(message, consumer="shop") is Outcome.APPLIED
    cancel = {"message_id": f"{order.pk}-cancel", "type": "order.cancelled", "order_id": order.pk}
    # pick_goods is not among django-SHOP's cancelable sources, but ready_for_delivery
    # is, and the order gets there: the cancel is kept until its condition holds.
    assert consume_message(cancel, consumer="shop") is Outcome.PARKED
    assert outcome_of(order)[0] == "pick_goods"
    for message in messages[3:]:
        assert consume_message(message, consumer="shop") is Outcome.APPLIED
    assert outcome_of(order) == ("refund_payment", "withdraw;refund;", ["12.00", "18.00"])
    row = ProcessedMessage.objects.get(consumer="shop", message_id=cancel["message_id"])
    assert row.outcome == Outcome.APPLIED
