"""Section 4 (celery-once): effects repeated when a worker is SIGKILLed mid-task, beside ours.

One worker process on a private RabbitMQ queue (which redelivers a killed
worker's unacknowledged messages at once) runs ``TASKS`` slow tasks, each with
its own key, with ``acks_late``: once under celery-once's ``QueueOnce`` (its
effect a Redis counter per key), once under ``@idempotent`` (its effect an order
row in the function's transaction). The worker is killed ``KILLS`` times while
a task sleeps, and a fresh one takes over. celery-once locks at enqueue time,
so the redelivered task runs its effect again; the inbox rolls the killed run
back and lets the redelivery run it once.
"""

from __future__ import annotations

import importlib.util
import os
import time
import uuid
from collections.abc import Callable

from bench.common import Row, na, setup

TASKS = int(os.environ.get("BENCH_ONCE_TASKS", "6"))
KILLS = int(os.environ.get("BENCH_ONCE_KILLS", "3"))
DELAY = float(os.environ.get("BENCH_ONCE_DELAY", "1.0"))


def _wait(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the workers did not finish in time")
        time.sleep(0.05)


def _measure(url: str, variant: str) -> tuple[int, int]:
    """(duplicate effects, kills done) for one variant."""
    import redis
    from celery import current_app
    from django.conf import settings

    from bench import tasks
    from idempotent_orders.models import Order
    from tests.support.services import Workers, worker_env

    queue = f"bench-once-{uuid.uuid4().hex[:8]}"
    counter = f"bench-once:{queue}"
    env = worker_env(broker_url=url, queue=queue, settings_module="bench.settings")
    current_app.conf.broker_url = url
    client = redis.Redis.from_url(settings.REDIS_URL)
    task = tasks.once_effect if variant == "celery-once" else tasks.idempotent_effect
    workers = Workers(url, queue, env)
    workers.start(1, 1)
    kills = 0
    try:
        with current_app.connection_for_write() as conn:
            for i in range(TASKS):
                task.apply_async(
                    kwargs={"counter": counter, "key": f"k{i}", "delay": DELAY},
                    connection=conn,
                    queue=queue,
                )
            for _ in range(KILLS):
                # Kill while a task is in its sleep: after a start, before it finishes.
                started = int(client.get(f"{counter}:started") or 0)
                _wait(lambda s=started: int(client.get(f"{counter}:started") or 0) > s, 120)
                time.sleep(DELAY / 3)
                workers.kill(len(workers.procs) - 1)
                kills += 1
                workers.start(1, 1)
            _wait(lambda: int(client.get(f"{counter}:finished") or 0) >= TASKS, 300)
            conn.default_channel.queue_delete(queue)
        if variant == "celery-once":
            effects = [int(client.get(f"{counter}:effect:k{i}") or 0) for i in range(TASKS)]
        else:
            effects = [
                Order.objects.filter(business_key__startswith=f"{counter}:k{i}:").count()
                for i in range(TASKS)
            ]
        return sum(max(e - 1, 0) for e in effects), kills
    finally:
        workers.stop()
        for name in client.scan_iter(f"{counter}*"):
            client.delete(name)


def run() -> list[Row]:
    if importlib.util.find_spec("celery_once") is None:
        return [na("4 peers: celery-once", "dups after a worker kill", "celery-once not installed")]
    setup()
    from tests.support.services import BROKERS, service_reachable

    url = BROKERS["rabbitmq"]()
    if not service_reachable(url):
        return [na("4 peers: celery-once", "dups after a worker kill", "RabbitMQ not reachable")]
    rows = []
    for variant in ("celery-once", "@idempotent"):
        try:
            dups, kills = _measure(url, variant)
        except Exception as exc:  # one variant failing must not hide the other
            rows.append(na("4 peers: celery-once", f"{variant}: dups", repr(exc)[:80]))
            continue
        rows.append(
            Row(
                "4 peers: celery-once",
                f"{variant}: effects repeated, {TASKS} slow tasks",
                str(dups),
                f"{kills} SIGKILLs of the worker mid-task, acks_late, RabbitMQ",
            )
        )
    return rows


if __name__ == "__main__":
    from bench.common import print_table

    print_table(run())
