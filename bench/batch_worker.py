"""Section 2b: the batch consumer (``consume_orders_in_batches``) beside the per-message Celery task.

Both consume the same kind of ``consume_payment`` task messages, published to
the queue before the consumers start; the clock starts when the first consumer
subscribes to the queue and stops when every message has its inbox row. Two
processes each, on RabbitMQ, in the same run.
"""

from __future__ import annotations

import os
import time
import uuid

from bench.common import Row, fmt, make_orders, na, payment, setup

N = int(os.environ.get("BENCH_BATCH_WORKER_MESSAGES", "3000"))
PROCESSES = 2
BATCH_SIZE = int(os.environ.get("BENCH_BATCH_SIZE", "200"))


def _consumers(queue: str) -> int:
    from celery import current_app

    with current_app.connection_for_write() as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).consumer_count)


def _measure(url: str, kind: str) -> float:
    from celery import current_app

    from idempotent_orders.models import ProcessedMessage
    from idempotent_orders.tasks import consume_payment
    from tests.support.services import BatchConsumers, Workers, worker_env

    queue = f"bench-{kind}-{uuid.uuid4().hex[:8]}"
    env = worker_env(broker_url=url, queue=queue, settings_module="bench.settings")
    current_app.conf.broker_url = url
    current_app.conf.task_default_queue = queue
    tag = f"{queue}-"
    orders = make_orders(N)
    with current_app.connection_for_write() as conn:
        current_app.amqp.queues[queue].bind(conn.default_channel).declare()
        for o in orders:
            m = payment(o, tag)
            consume_payment.apply_async(
                args=[m], task_id=m["message_id"], connection=conn, queue=queue
            )
    workers: Workers
    if kind == "batch":
        workers = BatchConsumers(url, queue, env, batch_size=BATCH_SIZE, flush_interval=0.1)
    else:
        workers = Workers(url, queue, env)
    rows = ProcessedMessage.objects.filter(message_id__startswith=f"pay-{tag}")
    try:
        workers.start(PROCESSES, 1)
        _wait(lambda: _consumers(queue) >= 1, 120, 0.01)
        start = time.perf_counter()
        _wait(lambda: rows.count() >= N, 300, 0.05)
        elapsed = time.perf_counter() - start
    finally:
        workers.stop()
        with current_app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
    return N / elapsed


def _wait(predicate, timeout: float, interval: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("consumers did not finish in time")
        time.sleep(interval)


def run() -> list[Row]:
    setup()
    from tests.support.services import BROKERS, service_reachable

    url = BROKERS["rabbitmq"]()
    section = "2b batch consumer"
    if not service_reachable(url):
        return [na(section, "rabbitmq", f"rabbitmq not reachable at {url}")]
    try:
        single = _measure(url, "task")
        batch = _measure(url, "batch")
    except Exception as exc:
        return [na(section, "rabbitmq, 2 proc", repr(exc)[:80])]
    return [
        Row(
            section,
            f"rabbitmq, {PROCESSES} proc, {N:,} msgs: consume_orders_in_batches --batch-size {BATCH_SIZE}",
            fmt(batch),
            f"{batch / single:.1f}x the consume_payment task, {PROCESSES} worker proc ({fmt(single)})",
            figure=batch,
            baseline=single,
            baseline_what=f"consume_payment task, {PROCESSES} proc",
        )
    ]


if __name__ == "__main__":
    from bench.common import print_table

    print_table(run())
