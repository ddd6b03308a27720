"""PostgreSQL: a new message is claimed and applied in one statement, and a lost race undoes it."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.models import F
from django.test.utils import CaptureQueriesContext
from django_fsm.signals import post_transition

from idempotent_orders import services, statements
from idempotent_orders.models import Order, OrderStatus, Outcome, ProcessedMessage
from idempotent_orders.services import consume_message
from tests.support.messages import payment, shipment

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.backends("postgresql")]


def test_a_new_message_costs_one_read_and_one_statement(make_order) -> None:
    consume_message(payment(make_order()), consumer="payments")  # loads this process's Bloom filter
    order = make_order()
    with CaptureQueriesContext(connection) as queries:
        assert consume_message(payment(order, seq=1), consumer="payments") is Outcome.APPLIED
    sql = [q["sql"] for q in queries.captured_queries]
    assert len(sql) == 2, sql
    assert sql[0].startswith("SELECT")
    assert sql[1].startswith("WITH claim AS (INSERT INTO")
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version, row.last_seq, row.payment_id) == (
        OrderStatus.PAID,
        1,
        1,
        f"pay-{order.pk}",
    )
    inbox = ProcessedMessage.objects.get(order_id=order.pk)
    assert (inbox.outcome, inbox.status, inbox.seq) == (Outcome.APPLIED, "done", 1)
    assert inbox.created_at is not None
    assert consume_message(payment(order, seq=1), consumer="payments") in (
        Outcome.STALE,
        Outcome.DUPLICATE,
    )


def test_a_copy_of_a_claimed_message_is_a_duplicate_and_writes_nothing(make_order) -> None:
    order = make_order()
    message = payment(order)
    assert consume_message(message, consumer="payments") is Outcome.APPLIED
    fresh = Order.objects.get(pk=order.pk)
    # A copy decided against a stale read still loses to the unique index.
    verdict = services.decide(order, services.parse_envelope(message))
    with pytest.raises(services._Duplicate):
        services._write(services.parse_envelope(message), "payments", order, verdict, None)
    assert Order.objects.get(pk=order.pk).version == fresh.version
    assert ProcessedMessage.objects.filter(message_id=message["message_id"]).count() == 1


def test_an_order_moved_after_the_read_undoes_the_claim_and_decides_again(
    make_order, monkeypatch
) -> None:
    order = make_order()
    message = shipment(order)  # paid -> shipped; the order is pending: parked at first
    real = statements.claim_and_apply
    calls: list[int] = []

    def racing(row: Any, order_: Any, **kwargs: Any) -> bool:
        calls.append(kwargs["version"])
        if len(calls) == 1:
            # Another writer changes the order between our read and our statement.
            Order.objects.filter(pk=order_.pk).update(version=F("version") + 1)
        return real(row, order_, **kwargs)

    monkeypatch.setattr(services, "claim_and_apply", racing)
    consume_message(payment(order), consumer="payments")
    assert calls == [0, 1]  # the first statement was undone; the second read v1
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version) == (OrderStatus.PAID, 2)
    assert ProcessedMessage.objects.filter(order_id=order.pk).count() == 1
    assert consume_message(message, consumer="shipping") is Outcome.APPLIED


def test_work_inside_the_transaction_takes_the_general_path(make_order) -> None:
    order = make_order()
    seen: list[str] = []

    def receiver(sender: Any, instance: Any, name: str, **kwargs: Any) -> None:
        seen.append(name)

    post_transition.connect(receiver, sender=Order)
    try:
        with CaptureQueriesContext(connection) as queries:
            consume_message(payment(order), consumer="payments")
    finally:
        post_transition.disconnect(receiver, sender=Order)
    sql = [q["sql"] for q in queries.captured_queries]
    assert seen == ["pay"]
    assert "BEGIN" in sql  # a receiver may write in the transaction: a real one is opened
    assert not any(s.startswith("WITH claim") for s in sql)
