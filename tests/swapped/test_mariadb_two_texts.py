"""MariaDB's two texts for a transition that runs the project's code (``writing._in_two_texts``):
``START TRANSACTION`` + the order's read + the claim, then UPDATE + guard + outbox row +
``COMMIT``, with the same result as the usual road, and the usual road wherever that
cannot hold.

A ``pre_transition`` receiver makes ``shop.Order.settle`` (no body) run the project's code;
``FlowOrder.pay`` has a body that writes a row of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any
from unittest import mock

import pytest
from django.test import override_settings

from idempotent_orders.consuming import running, writing
from idempotent_orders.consuming.failures import MessageFailed
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import (
    InboxStatus,
    OutboxMessage,
    Outcome,
    ProcessedMessage,
    SpentPayment,
)
from tests.shop.models import FlowOrder, Order, Payment, Phase
from tests.support.messages import payment
from tests.support.round_trips import round_trips

# The cases whose outcome is the same on both databases, run here on MariaDB.
from tests.swapped.test_postgresql_two_texts import (  # noqa: F401
    _Refusing,
    test_a_message_waiting_for_it_is_released,
    test_an_order_that_moved_after_the_read_rolls_everything_back,
    test_threads_deliver_a_storm_exactly_once,
)

pytestmark = [pytest.mark.backends("mysql"), pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def warm(make_order: Callable[..., Any]) -> None:
    """One message first: what the first one of a process does once is not counted."""
    consume_message(payment(make_order()), consumer="payments")


def _declined(*args: Any, **kwargs: Any) -> None:
    """The two texts standing aside: the road reads, then writes one statement at a time."""
    return None


@pytest.mark.parametrize("fulfil", [False, True], ids=["no-follow-up", "outbox-row"])
def test_a_transition_with_a_receiver_takes_two_round_trips(
    make_order, heard, settings, fulfil
) -> None:
    settings.IDEMPOTENT_ORDERS = {
        **settings.IDEMPOTENT_ORDERS,
        "FULFIL_AFTER_PAYMENT": fulfil,
        "OUTBOX_PUBLISH_ON_COMMIT": False,
    }
    order, usual = make_order(), make_order()
    texts: list[str] = []
    with round_trips(texts) as trips:
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
        sent = trips()
    with mock.patch.object(writing, "_in_two_texts", _declined), round_trips() as trips:
        assert consume_message(payment(usual), consumer="payments") is Outcome.APPLIED
        usual_sent = trips()
    assert sent == 2, texts
    assert texts[0].startswith("START TRANSACTION; SELECT ")
    assert " FOR UPDATE; INSERT INTO " in texts[0]
    assert texts[1].startswith("UPDATE ")
    assert texts[1].endswith("; COMMIT")
    assert ("INSERT IGNORE INTO" in texts[1]) is fulfil
    assert usual_sent > sent + 2  # the read, autocommit off and on, the claim, COMMIT
    assert heard == [(order.pk, "settle"), (usual.pk, "settle")]
    for one in (order, usual):
        row = Order.objects.get(pk=one.pk)
        assert (row.phase, row.version) == (Phase.SETTLED, 1)
        inbox = ProcessedMessage.objects.get(consumer="payments", order_id=one.pk)
        assert (inbox.status, inbox.outcome, inbox.error) == (InboxStatus.DONE, Outcome.APPLIED, "")
        assert SpentPayment.objects.get(payment_id=f"pay-{one.pk}").order_id == one.pk
        queued = OutboxMessage.objects.filter(message_id=f"fulfil-{one.pk}").count()
        assert queued == (1 if fulfil else 0)
    # The session's autocommit is on again, as Django believes.
    from django.db import connection

    assert connection.get_autocommit()
    assert connection.connection.get_autocommit()


def test_a_body_that_writes_and_spends_a_payment(make_order, pay_with_money) -> None:
    order = make_order(amount=Decimal("10.00"))
    message = {
        "message_id": f"pay-{order.pk}",
        "type": "flow.pay",
        "order_id": order.pk,
        "payload": {"payment_id": f"P{order.pk}", "amount": "10.00"},
    }
    with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="shop.FlowOrder"):
        texts: list[str] = []
        with round_trips(texts) as trips:
            assert consume_message(message, consumer="payments") is Outcome.APPLIED
            sent = trips()
        # The same payment for another order: the claim is rolled back, the usual road
        # says why.
        other = make_order(amount=Decimal("10.00"))
        again = {**message, "message_id": f"again-{order.pk}", "order_id": other.pk}
        assert consume_message(again, consumer="payments") is Outcome.REJECTED
    assert sent == 3, texts  # the body's own INSERT between the two texts
    row = FlowOrder.objects.get(pk=order.pk)
    assert (row.flow, row.paid_total, row.version) == ("paid", Decimal("10.00"), 1)
    assert list(Payment.objects.filter(order=order).values_list("payment_id", flat=True)) == [
        f"P{order.pk}"
    ]
    assert SpentPayment.objects.get(payment_id=f"P{order.pk}").order_id == order.pk
    refused = ProcessedMessage.objects.get(message_id=f"again-{order.pk}")
    assert f"already paid order {order.pk}" in refused.error
    assert FlowOrder.objects.get(pk=other.pk).version == 0
    assert not Payment.objects.filter(order_id=other.pk).exists()


def test_a_follow_up_that_writes_on_its_own_commits_with_the_transition(make_order, heard) -> None:
    order = make_order()
    follow_up = _Refusing()
    running.register_follow_up(follow_up)
    texts: list[str] = []
    try:
        with round_trips(texts) as trips:
            with pytest.raises(MessageFailed):
                consume_message(payment(order), consumer="payments")
            trips()
    finally:
        running._follow_ups.remove(follow_up)
    assert texts[0].startswith("START TRANSACTION; ")
    assert texts[1].startswith("UPDATE ")
    assert not texts[1].endswith("COMMIT")
    row = Order.objects.get(pk=order.pk)
    assert (row.phase, row.version) == (Phase.NEW, 0)  # nothing of it committed
    inbox = ProcessedMessage.objects.get(consumer="payments", order_id=order.pk)
    assert inbox.status == InboxStatus.FAILED
