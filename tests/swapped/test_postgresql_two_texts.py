"""PostgreSQL's road for a transition that runs the project's code (``writing._in_two_texts``):
two texts, ``BEGIN`` + claim + read, then UPDATE + outbox row + ``COMMIT``, with the same
result as the usual road, and the usual road wherever that cannot hold.

A ``pre_transition`` receiver makes ``shop.Order.settle`` (no body) run the project's code;
``FlowOrder.pay`` has a body that writes a row of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models import F
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django_fsm.signals import pre_transition

from idempotent_orders.consuming import running
from idempotent_orders.consuming.failures import MessageFailed
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.consuming.sql import inbox_partitioned
from idempotent_orders.models import (
    InboxStatus,
    OutboxMessage,
    Outcome,
    ProcessedMessage,
    SpentPayment,
)
from tests.shop.models import FlowOrder, Order, Payment, Phase
from tests.support.messages import payment, shipment
from tests.support.pgbouncer import pgbouncer
from tests.support.round_trips import round_trips
from tests.support.threads import run_threads
from tests.swapped.test_own_model import assert_all_received_once, storm

pytestmark = [pytest.mark.backends("postgresql"), pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def warm(make_order: Callable[..., Any]) -> None:
    """One message first: what the first one of a process does once (the Bloom filter
    read from the inbox, the statements compiled) is not what these tests count."""
    consume_message(payment(make_order()), consumer="payments")


def sent_texts(queries: CaptureQueriesContext) -> list[str]:
    """The statements sent, without the BEGIN and COMMIT Django logs for its own
    ``atomic`` whether or not the driver sent them."""
    return [q["sql"] for q in queries.captured_queries if q["sql"] not in ("BEGIN", "COMMIT")]


def test_a_transition_with_a_receiver_takes_two_round_trips(make_order, heard) -> None:
    order = make_order()
    with round_trips() as trips, CaptureQueriesContext(connection) as queries:
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
        sent = trips()
    assert sent == 2
    texts = sent_texts(queries)
    assert len(texts) == 2
    assert texts[0].startswith("BEGIN; ")
    assert texts[1].endswith("; COMMIT")
    # Captured queries show the statements themselves, not EXECUTE of prepared ones.
    assert not any("EXECUTE" in text for text in texts)
    assert heard == [(order.pk, "settle")]
    row = Order.objects.get(pk=order.pk)
    assert (row.phase, row.version, row.has_parked) == (Phase.SETTLED, 1, False)
    inbox = ProcessedMessage.objects.get(consumer="payments", order_id=order.pk)
    assert (inbox.status, inbox.outcome, inbox.error) == (InboxStatus.DONE, Outcome.APPLIED, "")


def test_a_body_that_writes_and_spends_a_payment(make_order, pay_with_money) -> None:
    order = make_order(amount=Decimal("10.00"))
    message = {
        "message_id": f"pay-{order.pk}",
        "type": "flow.pay",
        "order_id": order.pk,
        "payload": {"payment_id": f"P{order.pk}", "amount": "10.00"},
    }
    with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="shop.FlowOrder"):
        with round_trips() as trips:
            assert consume_message(message, consumer="payments") is Outcome.APPLIED
            sent = trips()
        # The same payment for another order: the claim is rolled back, the usual road
        # says why.
        other = make_order(amount=Decimal("10.00"))
        again = {**message, "message_id": f"again-{order.pk}", "order_id": other.pk}
        assert consume_message(again, consumer="payments") is Outcome.REJECTED
    assert sent == 3  # the body's own INSERT between the two texts
    row = FlowOrder.objects.get(pk=order.pk)
    assert (row.flow, row.paid_total, row.version) == ("paid", Decimal("10.00"), 1)
    assert list(Payment.objects.filter(order=order).values_list("payment_id", flat=True)) == [
        f"P{order.pk}"
    ]
    assert SpentPayment.objects.get(payment_id=f"P{order.pk}").order_id == order.pk
    refused = ProcessedMessage.objects.get(message_id=f"again-{order.pk}")
    assert f"already paid order {order.pk}" in refused.error
    assert FlowOrder.objects.get(pk=other.pk).version == 0


@pytest.mark.parametrize("fulfil", [False, True], ids=["no-follow-up", "outbox-row"])
def test_an_order_that_moved_after_the_read_rolls_everything_back(
    make_order, settings, fulfil
) -> None:
    settings.IDEMPOTENT_ORDERS = {
        **settings.IDEMPOTENT_ORDERS,
        "FULFIL_AFTER_PAYMENT": fulfil,  # the second text queues the outbox row too
        "OUTBOX_PUBLISH_ON_COMMIT": False,
    }
    order = make_order()
    calls: list[int] = []

    def bump_once(sender: Any, instance: Any, **kwargs: Any) -> None:
        # Another writer's UPDATE between our read and our write (here in our own
        # transaction, so that it is rolled back with it).
        calls.append(instance.version)
        if len(calls) == 1:
            Order.objects.filter(pk=instance.pk).update(version=F("version") + 1)

    pre_transition.connect(bump_once, weak=False, dispatch_uid="test-bump-once")
    try:
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    finally:
        pre_transition.disconnect(dispatch_uid="test-bump-once")
    assert calls == [0, 0]  # rolled back whole, then decided and run again
    row = Order.objects.get(pk=order.pk)
    assert (row.phase, row.version) == (Phase.SETTLED, 1)
    assert ProcessedMessage.objects.filter(order_id=order.pk).count() == 1
    queued = OutboxMessage.objects.filter(message_id=f"fulfil-{order.pk}").count()
    assert queued == (1 if fulfil else 0)


class _Refusing:
    """A follow-up that writes on its own (no ``outbox_row``), and raises."""

    def wanted(self, model: type[Any], target: Any) -> bool:
        return target == Phase.SETTLED

    def write(self, instance: Any, name: str, result: Any) -> None:
        raise RuntimeError("the follow-up failed")


def test_a_follow_up_that_writes_on_its_own_commits_with_the_transition(make_order, heard) -> None:
    order = make_order()
    follow_up = _Refusing()
    running.register_follow_up(follow_up)
    try:
        with CaptureQueriesContext(connection) as queries, pytest.raises(MessageFailed):
            consume_message(payment(order), consumer="payments")
    finally:
        running._follow_ups.remove(follow_up)
    texts = sent_texts(queries)
    assert texts[0].startswith("BEGIN; ")
    assert not texts[1].endswith("COMMIT")
    row = Order.objects.get(pk=order.pk)
    assert (row.phase, row.version) == (Phase.NEW, 0)  # nothing of it committed
    inbox = ProcessedMessage.objects.get(consumer="payments", order_id=order.pk)
    assert inbox.status == InboxStatus.FAILED


def test_the_isolation_level_of_the_settings_begins_the_transaction(make_order) -> None:
    if inbox_partitioned():
        pytest.skip("a partitioned inbox is claimed at READ COMMITTED only")
    order = make_order()
    levels: list[str] = []

    def isolation(sender: Any, instance: Any, **kwargs: Any) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            levels.append(cursor.fetchone()[0])

    connection.ensure_connection()
    connection.connection.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
    pre_transition.connect(isolation, weak=False, dispatch_uid="test-isolation")
    try:
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    finally:
        pre_transition.disconnect(dispatch_uid="test-isolation")
        connection.connection.isolation_level = None
    assert levels == ["serializable"]
    assert Order.objects.get(pk=order.pk).phase == Phase.SETTLED


def test_a_message_waiting_for_it_is_released(make_order, heard) -> None:
    order = make_order()
    shipped = shipment(order, seq=2)
    assert consume_message(shipped, consumer="shipping") is Outcome.PARKED
    assert consume_message(payment(order, seq=1), consumer="payments") is Outcome.APPLIED
    row = Order.objects.get(pk=order.pk)
    assert (row.phase, row.version, row.last_seq) == (Phase.SENT, 2, 2)
    assert heard == [(order.pk, "settle"), (order.pk, "send")]


def test_threads_deliver_a_storm_exactly_once(make_order, heard) -> None:
    orders = [make_order() for _ in range(6)]
    deliveries = storm(orders, seed=5)
    outcomes = run_threads(deliveries, 4)
    assert sum(outcomes.values()) == len(deliveries)
    assert_all_received_once(orders)


def test_the_texts_run_prepared_statements_of_the_session(make_order, heard) -> None:
    first, second = make_order(), make_order()
    assert consume_message(payment(first), consumer="payments") is Outcome.APPLIED
    texts: list[str] = []  # the first message's texts prepared them
    with round_trips(texts) as trips:
        assert consume_message(payment(second), consumer="payments") is Outcome.APPLIED
        sent = trips()
    assert sent == 2
    assert texts[0].startswith('"BEGIN; EXECUTE idempotent_orders_')
    assert texts[0].count("; EXECUTE idempotent_orders_") == 2  # the claim, the read
    assert texts[1].startswith('"EXECUTE idempotent_orders_')
    assert texts[1].endswith('; COMMIT"')
    assert not any("PREPARE" in text for text in texts)


def test_a_session_that_lost_them_prepares_them_again(make_order, heard) -> None:
    first, order = make_order(), make_order()
    assert consume_message(payment(first), consumer="payments") is Outcome.APPLIED
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")  # as a pooler's other session, or DISCARD ALL
    assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    assert heard == [(first.pk, "settle"), (order.pk, "settle")]  # the usual road ran it
    row = Order.objects.get(pk=order.pk)
    assert (row.phase, row.version) == (Phase.SETTLED, 1)
    assert ProcessedMessage.objects.filter(order_id=order.pk).count() == 1
    texts: list[str] = []
    later = make_order()
    with round_trips(texts) as trips:
        assert consume_message(payment(later), consumer="payments") is Outcome.APPLIED
        sent = trips()
    assert sent == 2
    assert texts[0].count("PREPARE idempotent_orders_") == 2


def test_a_storm_through_pgbouncer_transaction_pooling_is_delivered_exactly_once(
    make_order, heard
) -> None:
    # Each transaction may go to another server session than the one that prepared the
    # statements: a miss rolls back and takes the usual road.
    orders = [make_order() for _ in range(6)]
    deliveries = storm(orders, seed=7)
    db = connections.settings[DEFAULT_DB_ALIAS]
    saved = dict(db)
    with pgbouncer(db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432), db["USER"]) as port:
        connections.settings[DEFAULT_DB_ALIAS] = {
            **saved,
            "HOST": "127.0.0.1",
            "PORT": str(port),
            "CONN_MAX_AGE": 600,
        }
        try:
            outcomes = run_threads(deliveries, 4)
        finally:
            connections.settings[DEFAULT_DB_ALIAS] = saved
    assert sum(outcomes.values()) == len(deliveries)
    assert_all_received_once(orders)
