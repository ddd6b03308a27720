"""Section 2: through real Celery worker processes, Redis and RabbitMQ brokers, beside a no-op task."""

from __future__ import annotations

import os
import time
import uuid

from bench.common import Row, fmt, make_orders, na, payment, setup

N = int(os.environ.get("BENCH_WORKER_MESSAGES", "300"))


def _measure(broker: str, url: str, processes: int) -> tuple[float, float]:
    import redis
    from celery import current_app
    from django.conf import settings

    from idempotent_orders.models import ProcessedMessage
    from idempotent_orders.tasks import consume_payment
    from tests.support.services import Workers, worker_env

    queue = f"bench-{uuid.uuid4().hex[:8]}"
    env = worker_env(broker_url=url, queue=queue, settings_module="bench.settings")
    current_app.conf.broker_url = url
    current_app.conf.task_default_queue = queue
    workers = Workers(url, queue, env)
    workers.start(processes, 1)
    client = redis.Redis.from_url(settings.REDIS_URL)
    counter = f"bench:{queue}"
    try:
        with current_app.connection_for_write() as conn:
            from bench.tasks import noop

            noop.apply_async(args=[counter], connection=conn, queue=queue)  # warm-up
            _wait(lambda: int(client.get(counter) or 0) >= 1, 60)
            start = time.perf_counter()
            for _ in range(N):
                noop.apply_async(args=[counter], connection=conn, queue=queue)
            _wait(lambda: int(client.get(counter) or 0) >= N + 1, 300)
            noop_rate = N / (time.perf_counter() - start)

            orders = make_orders(N)
            consumer = ProcessedMessage.objects.filter(consumer="payments")
            before = consumer.count()
            start = time.perf_counter()
            for o in orders:
                m = payment(o, f"{queue}-")
                consume_payment.apply_async(
                    args=[m], task_id=m["message_id"], connection=conn, queue=queue
                )
            _wait(lambda: consumer.count() >= before + N, 300)
            consume_rate = N / (time.perf_counter() - start)
            conn.default_channel.queue_delete(queue)
    finally:
        workers.stop()
        client.delete(counter)
    return consume_rate, noop_rate


def _wait(predicate, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("workers did not finish in time")
        time.sleep(0.05)


def run() -> list[Row]:
    setup()
    from django.conf import settings

    from tests.support.services import BROKERS, service_reachable

    rows = []
    for broker in ("redis", "rabbitmq"):
        url = BROKERS[broker]()
        if not service_reachable(url):
            rows.append(na("2 celery workers", broker, f"{broker} not reachable at {url}"))
            continue
        for processes in (1, 2):
            what = f"{broker}, {processes} worker proc"
            try:
                consume, noop = _measure(broker, url, processes)
            except Exception as exc:  # one broker failing must not hide the others
                rows.append(na("2 celery workers", what, repr(exc)[:80]))
                continue
            rows.append(
                Row(
                    "2 celery workers",
                    f"{what}: consume_payment",
                    fmt(consume),
                    f"{consume / noop:.0%} of the no-op task ({fmt(noop)})",
                    figure=consume,
                    baseline=noop,
                    baseline_what=f"no-op task, {processes} proc",
                )
            )
    del settings
    return rows


if __name__ == "__main__":
    from bench.common import print_table

    print_table(run())
