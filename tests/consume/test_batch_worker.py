"""``manage.py consume_orders_in_batches``: real processes on RabbitMQ, acked after commit."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from celery import current_app
from django.db import connection, transaction

from idempotent_orders.contrib.batch_worker import decode
from idempotent_orders.models import Order, OrderStatus, Outcome, ParkedMessage, ProcessedMessage
from idempotent_orders.tasks import consume_payment, publish
from tests.support.messages import duplicated_storm, payment
from tests.support.services import (
    BROKERS,
    BatchConsumers,
    require_service,
    require_workers_marker,
    reset_broker_pools,
    wait_until,
    worker_env,
)


def test_decode_reads_the_task_message_the_consumer_task_receives() -> None:
    message = {"message_id": "m1", "type": "payment.succeeded", "order_id": 1, "payload": {}}
    headers = {"task": "idempotent_orders.consume_payment", "id": "m1"}
    assert decode(headers, [[message], {}, {}]).message == message
    assert decode(headers, [[message], {}, {}]).consumer == "payments"
    assert decode(headers, [[], {"message": message}, {}]).message == message
    shipping = {"task": "idempotent_orders.consume_shipping"}
    assert decode(shipping, [[message], {}, {}]).consumer == "shipping"
    # protocol 1
    assert decode({}, {"task": "idempotent_orders.consume_payment", "args": [message]}).message == (
        message
    )
    # not a consumer task: no consumer, so it is dead-lettered rather than applied
    assert decode({"task": "idempotent_orders.purge"}, [[], {}, {}]).consumer is None
    # malformed arguments: the body goes to the inbox to be rejected, with the reason
    odd = decode(headers, [[message, message], {}, {}])
    assert odd.consumer == "payments"
    assert odd.problem
    assert odd.message == [[message, message], {}, {}]
    assert decode(headers, "junk").problem


@pytest.fixture
def batch_consumers(
    transactional_db: None, request: pytest.FixtureRequest
) -> Iterator[Callable[..., BatchConsumers]]:
    require_workers_marker(request)
    started: list[BatchConsumers] = []
    before = (current_app.conf.broker_url, current_app.conf.task_default_queue)

    def start(processes: int = 2, **options: float) -> BatchConsumers:
        url = BROKERS["rabbitmq"]()
        require_service("rabbitmq", url)
        queue = f"io-batch-{uuid.uuid4().hex[:10]}"
        current_app.conf.broker_url = url
        current_app.conf.task_default_queue = queue
        reset_broker_pools(current_app)
        consumers = BatchConsumers(url, queue, worker_env(broker_url=url, queue=queue), **options)  # type: ignore[arg-type]
        # The queue exists before anything is published, as with a Celery worker.
        with current_app.connection_for_write() as conn:
            current_app.amqp.queues[queue].bind(conn.default_channel).declare()
        consumers.start(processes)
        started.append(consumers)
        return consumers

    yield start
    for consumers in started:
        consumers.stop()
        try:
            with current_app.connection_for_write() as conn:
                conn.default_channel.queue_delete(consumers.queue)
        except Exception:
            pass
    current_app.conf.broker_url, current_app.conf.task_default_queue = before
    reset_broker_pools(current_app)


def _applied_once(ids: list[int], per_order: int) -> None:
    for order in Order.objects.filter(pk__in=ids):
        applied = order.inbox_messages.filter(outcome=Outcome.APPLIED).count()
        assert applied == per_order
        assert order.version == applied


@pytest.mark.workers
@pytest.mark.backends("postgresql", "mysql")
def test_two_consumers_apply_a_duplicated_permuted_storm_once(batch_consumers, make_order) -> None:
    consumers = batch_consumers(processes=2, batch_size=50, flush_interval=0.2)
    orders = [make_order() for _ in range(40)]
    deliveries = duplicated_storm(orders, seed=13)
    for consumer, message in deliveries:
        publish(message, consumer=consumer)
    ids = [o.pk for o in orders]
    assert wait_until(
        lambda: Order.objects.filter(pk__in=ids, status=OrderStatus.COMPLETED).count() == len(ids),
        timeout=120,
    ), consumers.log_tail()
    _applied_once(ids, 3)
    distinct = {m["message_id"] for _, m in deliveries}
    assert ProcessedMessage.objects.filter(order_id__in=ids).count() == len(distinct)
    assert not ParkedMessage.objects.exists()
    assert all(p.poll() is None for p in consumers.procs), consumers.log_tail()


@pytest.mark.workers
@pytest.mark.backends("postgresql")
def test_a_consumer_killed_mid_batch_has_its_batch_redelivered_and_applied_once(
    batch_consumers, make_order
) -> None:
    # One batch of 600 is two consume_batch chunks (500 + 100): the first commits,
    # the second waits on an order row this test holds locked, and the consumer is
    # SIGKILLed there. Nothing of the batch was acknowledged, so all 600 come back.
    from idempotent_orders.consuming.batch import CHUNK

    free = [make_order() for _ in range(CHUNK)]
    locked = [make_order() for _ in range(100)]
    consumers = batch_consumers(processes=0, batch_size=CHUNK + 100, flush_interval=3)
    for o in free + locked:
        publish(payment(o, message_id=f"k-{o.pk}"), consumer="payments")
    free_ids = [o.pk for o in free]
    with transaction.atomic():
        Order.objects.select_for_update().get(pk=locked[0].pk)
        consumers.start(1)
        assert wait_until(
            lambda: ProcessedMessage.objects.filter(order_id__in=free_ids).count() == CHUNK,
            timeout=60,
        ), consumers.log_tail()
        assert wait_until(lambda: _waiting_on_lock() > 0, timeout=30), consumers.log_tail()
        consumers.kill(0)  # SIGKILL mid-batch: the first chunk committed, nothing acked
    assert not ProcessedMessage.objects.filter(order__in=locked).exists()
    consumers.procs.append(consumers.spawn())
    ids = [o.pk for o in free + locked]
    assert wait_until(
        lambda: Order.objects.filter(pk__in=ids, status=OrderStatus.PAID).count() == len(ids),
        timeout=90,
    ), consumers.log_tail()
    _applied_once(ids, 1)
    assert ProcessedMessage.objects.filter(order_id__in=ids).count() == len(ids)
    # the redelivered first chunk met the inbox: the replacement consumed all 600 again
    assert wait_until(lambda: _queue_depth(consumers.queue) == 0, timeout=30)


def _waiting_on_lock() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()"
        )
        return int(cursor.fetchone()[0])


def _queue_depth(queue: str) -> int:
    with current_app.connection_for_write() as conn:
        ok = conn.default_channel.queue_declare(queue, passive=True)
        return int(ok.message_count)


@pytest.mark.workers
@pytest.mark.backends("postgresql")
def test_malformed_deliveries_are_recorded_acked_and_the_loop_goes_on(
    batch_consumers, make_order
) -> None:
    consumers = batch_consumers(processes=1, batch_size=20, flush_interval=0.2)
    order = make_order()
    bad = [
        {"type": "payment.succeeded"},  # no message_id
        {"message_id": "b1", "type": "teleport", "order_id": order.pk, "payload": {}},
        {"message_id": "b2", "type": "payment.succeeded", "order_id": order.pk, "payload": "no"},
        "not even a dict",
    ]
    for message in bad:
        consume_payment.apply_async(args=[message])
    # two arguments where the task takes one, and a body that is not JSON at all
    current_app.send_task("idempotent_orders.consume_payment", args=[{"message_id": "b3"}, "extra"])
    with current_app.connection_for_write() as conn:
        producer = conn.Producer()
        producer.publish(
            b"\xff{not json",
            routing_key=consumers.queue,
            content_type="application/json",
            content_encoding="binary",
            headers={"task": "idempotent_orders.consume_payment", "id": "raw-1"},
        )
        producer.publish(
            json.dumps([[], {}, {}]),
            routing_key=consumers.queue,
            content_type="application/json",
            content_encoding="utf-8",
            headers={"task": "somebody.elses_task", "id": "raw-2"},
        )
    publish(payment(order, message_id="good"), consumer="payments")
    expected = len(bad) + 2
    assert wait_until(
        lambda: (
            ProcessedMessage.objects.filter(message_id="good").exists()
            and ProcessedMessage.objects.filter(outcome=Outcome.REJECTED).count() == expected
        ),
        timeout=60,
    ), consumers.log_tail()
    rejected = ProcessedMessage.objects.filter(outcome=Outcome.REJECTED)
    assert all(row.error for row in rejected)
    assert Order.objects.get(pk=order.pk).status == OrderStatus.PAID
    assert wait_until(lambda: _queue_depth(consumers.queue) == 0, timeout=30)
    assert consumers.procs[0].poll() is None  # still alive
    assert "somebody.elses_task" in consumers.log_tail()


@pytest.mark.workers
@pytest.mark.backends("postgresql")
def test_sigterm_finishes_the_batch_at_hand_and_stops(batch_consumers, make_order) -> None:
    import signal

    consumers = batch_consumers(processes=1, batch_size=1000, flush_interval=30)
    orders = [make_order() for _ in range(20)]
    for o in orders:
        publish(payment(o, message_id=f"t-{o.pk}"), consumer="payments")
    assert wait_until(lambda: _queue_depth(consumers.queue) == 0, timeout=30)  # all prefetched
    # Sent to the consumer is not yet taken into its batch: give a busy machine a moment.
    time.sleep(1.0)
    consumers.procs[0].send_signal(signal.SIGTERM)
    assert consumers.procs[0].wait(30) == 0, consumers.log_tail()
    ids = [o.pk for o in orders]
    assert Order.objects.filter(pk__in=ids, status=OrderStatus.PAID).count() == len(ids)
    assert _queue_depth(consumers.queue) == 0  # acknowledged, not returned
