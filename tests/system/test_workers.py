"""Real Celery worker processes on Redis and RabbitMQ brokers consume duplicates exactly once."""

from __future__ import annotations

from collections import Counter

import pytest

from idempotent_orders.models import Order, OrderStatus, Outcome, ParkedMessage, ProcessedMessage
from idempotent_orders.tasks import consume_payment, publish
from tests.support.messages import duplicated_storm, payment
from tests.support.services import wait_until

# workers_on_every_django: the Celery worker's Django integration (connections closed and
# reopened around tasks) under each Django version: also on Django 6's PostgreSQL leg.
pytestmark = [
    pytest.mark.workers,
    pytest.mark.workers_on_every_django,
    pytest.mark.backends("postgresql"),
]


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_workers_apply_each_message_once(broker: str, celery_workers, make_order, settings) -> None:
    settings.IDEMPOTENT_ORDERS = {"FULFIL_AFTER_PAYMENT": True}
    workers = celery_workers(broker, processes=2, extra_env={"IO_TEST_FULFIL": "1"})
    orders = [make_order() for _ in range(15)]
    deliveries = duplicated_storm(orders, seed=5)
    for consumer, message in deliveries:
        publish(message, consumer=consumer)
    ids = [o.pk for o in orders]
    done = wait_until(
        lambda: (
            Order.objects.filter(pk__in=ids, status=OrderStatus.COMPLETED).count() == len(ids)
            and ProcessedMessage.objects.filter(consumer="fulfilment", order_id__in=ids).count()
            == len(ids)
        ),
        timeout=120,
    )
    assert done, workers.log_tail()
    for order in Order.objects.filter(pk__in=ids):
        applied = order.inbox_messages.filter(outcome=Outcome.APPLIED).count()
        assert order.version == applied
        assert applied in (3, 4)  # fulfilment applies unless dispatch won the race
    assert ProcessedMessage.objects.filter(order_id__in=ids).exclude(consumer="fulfilment").filter(
        outcome=Outcome.APPLIED
    ).count() == len({m["message_id"] for _, m in deliveries})
    assert not ParkedMessage.objects.exists()


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_bad_input_is_recorded_and_the_worker_keeps_consuming(
    broker: str, celery_workers, make_order
) -> None:
    workers = celery_workers(broker, processes=1)
    order = make_order()
    bad = [
        {"type": "payment.succeeded"},  # no message_id
        {"message_id": "x" * 10_000, "type": "payment.succeeded", "order_id": order.pk},
        {"message_id": "b1", "type": "teleport", "order_id": order.pk, "payload": {}},
        {"message_id": "b2", "type": "payment.succeeded", "order_id": order.pk, "payload": "no"},
        {"message_id": "b3", "type": "payment.succeeded", "order_id": 999_999_999, "payload": {}},
        payment(order, message_id="b4", amount="-1"),
        payment(order, message_id="b5", currency="USD"),
        {
            "message_id": "b6",
            "type": "payment.succeeded",
            "order_id": order.pk,
            "payload": {"blob": "A" * (10 * 1024 * 1024)},
        },
        {"message_id": "b7\x00", "type": "payment.succeeded", "order_id": order.pk},
        {
            "message_id": "b8",
            "type": "payment.succeeded",
            "order_id": order.pk,
            "payload": {"payment_id": "nul\x00byte", "amount": "12.50", "currency": "CNY"},
        },
        "not even a dict",
    ]
    for message in bad:
        consume_payment.apply_async(args=[message])
    good = payment(order, message_id="good")
    publish(good, consumer="payments")
    assert wait_until(
        lambda: (
            ProcessedMessage.objects.filter(message_id="good").exists()
            and ProcessedMessage.objects.filter(outcome=Outcome.REJECTED).count() == len(bad)
        ),
        timeout=90,
    ), workers.log_tail()
    rejected = ProcessedMessage.objects.filter(outcome=Outcome.REJECTED)
    assert all(row.error for row in rejected)
    reasons = Counter(row.error.split(" ")[0] for row in rejected)
    assert sum(reasons.values()) == len(bad)
    assert Order.objects.get(pk=order.pk).status == OrderStatus.PAID
    assert workers.procs[0].poll() is None  # still alive
