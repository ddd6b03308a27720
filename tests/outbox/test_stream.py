"""A shuffled, duplicated, out-of-order stream through threads and worker processes.

PostgreSQL only: the races that matter (lost wake-ups, inbox conflicts) need
real concurrent transactions.
"""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from django.db import OperationalError, close_old_connections, connection
from django.test.utils import CaptureQueriesContext

from idempotent_orders import dedup, stats
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.exceptions import ConcurrentUpdate
from idempotent_orders.models import (
    Order,
    OrderStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.tasks import publish
from tests.support.messages import payment, shipment
from tests.support.services import RedisServer, private_redis_settings, wait_until

pytestmark = [pytest.mark.backends("postgresql"), pytest.mark.services]

Message = tuple[dict[str, Any], str]  # (envelope, consumer)


def build_stream(orders: list[Order], rng: random.Random) -> tuple[list[Message], list[Message]]:
    """Three messages per order (half with seq, half ordered by the graph only),
    each sent 1-5 times, all shuffled. Returns (unique messages, the stream)."""
    unique: list[Message] = []
    for i, order in enumerate(orders):
        with_seq = i % 2 == 0
        unique += [
            (payment(order, seq=1 if with_seq else None), "payments"),
            (shipment(order, seq=2 if with_seq else None), "shipping"),
            (shipment(order, "delivered", seq=3 if with_seq else None), "shipping"),
        ]
    stream = [m for m in unique for _ in range(rng.randint(1, 5))]
    rng.shuffle(stream)
    return unique, stream


def consume_in_threads(stream: list[Message], threads: int) -> Counter[str]:
    """Each thread takes every n-th message; transient errors are retried as the task does."""
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run(part: list[Message]) -> None:
        try:
            for message, consumer in part:
                for _ in range(20):
                    try:
                        outcome = consume_message(message, consumer=consumer)
                        break
                    except (OperationalError, ConcurrentUpdate):
                        close_old_connections()
                else:
                    raise AssertionError(f"{message['message_id']} kept failing")
                with lock:
                    outcomes[outcome.value] += 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    workers = [threading.Thread(target=run, args=(stream[i::threads],)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, errors
    return outcomes


def assert_exactly_once(orders: list[Order], unique: list[Message]) -> None:
    for order in Order.objects.filter(pk__in=[o.pk for o in orders]):
        assert order.status == OrderStatus.COMPLETED, order
        assert order.version == 3, order
        assert order.last_seq in (0, 3)
    assert not ParkedMessage.objects.exists()
    rows = ProcessedMessage.objects.filter(message_id__in=[m["message_id"] for m, _ in unique])
    assert rows.count() == len(unique)
    assert set(rows.values_list("outcome", flat=True)) == {Outcome.APPLIED}


def all_done(orders: list[Order], unique: list[Message]) -> Callable[[], bool]:
    def check() -> bool:
        done = Order.objects.filter(
            pk__in=[o.pk for o in orders], status=OrderStatus.COMPLETED
        ).count()
        applied = ProcessedMessage.objects.filter(outcome=Outcome.APPLIED).count()
        return done == len(orders) and applied == len(unique)

    return check


def publish_all(stream: list[Message]) -> None:
    for message, consumer in stream:
        publish(message, consumer=consumer)


@pytest.mark.workers
def test_shuffled_stream_through_threads_and_processes_then_resend(
    make_order, celery_workers, capsys
) -> None:
    rng = random.Random(3)
    orders = [make_order() for _ in range(30)]
    unique, stream = build_stream(orders, rng)
    stats.reset(shared=True)
    workers = celery_workers("redis", processes=2, concurrency=2)
    # Half the copies go to worker processes, the other half to threads here, at once.
    to_workers, here = stream[::2], stream[1::2]
    sender = threading.Thread(target=publish_all, args=(to_workers,))
    sender.start()
    outcomes = consume_in_threads(here, threads=3)
    sender.join()
    assert wait_until(all_done(orders, unique), timeout=120), workers.log_tail()
    assert_exactly_once(orders, unique)
    assert outcomes["applied"] + outcomes["parked"] <= len(here)

    # Re-send the whole stream here with Redis up: a worker starting now would
    # load the inbox into its Bloom filter, and so does this process.
    dedup.reset()
    dedup.bloom.rebuild()
    with CaptureQueriesContext(connection) as queries:
        resent = Counter(
            consume_message(message, consumer=consumer).value for message, consumer in stream
        )
    assert resent == {"duplicate": len(stream)}
    assert len(queries) < 0.01 * len(stream), [q["sql"][:120] for q in queries.captured_queries]
    assert_exactly_once(orders, unique)

    workers.stop()
    stats.flush()
    counts = stats.read()
    with capsys.disabled():
        print(
            f"\nstream: {len(unique)} messages, {len(stream)} deliveries; "
            f"re-send: {len(stream)} duplicates, {len(queries)} queries\n"
            f"counters: {json.dumps(counts, sort_keys=True)}"
        )
    assert counts["layer:redis-hit"] >= len(stream)
    assert counts["outcome:applied"] == len(unique)


@pytest.mark.workers
def test_stream_stays_exactly_once_when_redis_is_flushed_then_down(
    make_order, celery_workers
) -> None:
    rng = random.Random(4)
    orders = [make_order() for _ in range(24)]
    unique, stream = build_stream(orders, rng)
    server = RedisServer()
    server.start()
    try:
        with private_redis_settings(server.url):
            workers = celery_workers(
                "redis",
                processes=2,
                concurrency=1,
                extra_env={"IO_TEST_DEDUP_REDIS_URL": server.url},
            )
            third = len(stream) // 3
            publish_all(stream[:third])
            consume_in_threads(stream[third : 2 * third], threads=2)
            server.flushall()  # mid-run: every processed: key is gone
            publish_all(stream[2 * third :])
            consume_in_threads(stream[2 * third :], threads=2)
            server.stop()  # and now Redis is down for everyone
            publish_all(stream[:third])
            consume_in_threads(stream, threads=2)
            assert wait_until(all_done(orders, unique), timeout=120), workers.log_tail()
            assert_exactly_once(orders, unique)
            assert stats.local().get("layer:redis-down", 0) >= 1
    finally:
        server.stop()
