"""Fault injection with real worker processes: SIGKILLs, broker restart, FLUSHALL, lost DB links."""

from __future__ import annotations

import json
import os
import random
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from celery import current_app
from django.conf import settings

from tests.support.chaos import ChaosContext, build_stream, make_orders, rabbitmq_restart, run_chaos
from tests.support.services import (
    BatchConsumers,
    RedisServer,
    Workers,
    require_service,
    reset_broker_pools,
    worker_env,
)

pytestmark = [
    pytest.mark.backends("postgresql"),
    pytest.mark.workers,
    pytest.mark.heavy,
    pytest.mark.services,
]


@dataclass(frozen=True)
class Load:
    orders: int
    kills: int
    workers: int
    max_copies: int = 5


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


#: Bounded: inside `make test` and CI. Long: `make chaos`, sized by environment variables.
BOUNDED = Load(orders=_env_int("IO_CHAOS_ORDERS", 15), kills=5, workers=2)
LONG = Load(
    orders=_env_int("IO_CHAOS_LONG_ORDERS", 200),
    kills=_env_int("IO_CHAOS_LONG_KILLS", 15),
    workers=_env_int("IO_CHAOS_LONG_WORKERS", 3),
)


def schedule(kills: int) -> tuple[str, ...]:
    # Broker-wiping faults first (see DEFAULT_SCHEDULE), the connection kill among the SIGKILLs.
    rest = ["kill_worker"] * kills
    rest.insert(1, "terminate_db")
    return ("restart_broker", "flush_redis", *rest)


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    redis = RedisServer()
    redis.start()
    yield redis
    redis.stop()


@pytest.fixture
def use_broker() -> Iterator[None]:
    before = (current_app.conf.broker_url, current_app.conf.task_default_queue)
    yield
    current_app.conf.broker_url, current_app.conf.task_default_queue = before
    reset_broker_pools()


def chaos_broker(
    broker: str, private_redis: RedisServer, queue: str
) -> tuple[str, Callable[[], None] | None]:
    """Point this process's Celery at ``broker`` and ``queue``: the broker's URL and how
    to restart it (None: restarting the shared RabbitMQ is opt-in, `make chaos` and CI
    set IO_CHAOS_RESTART_RABBITMQ=1)."""
    restart: Callable[[], None] | None
    if broker == "redis":
        broker_url = private_redis.url
        restart = private_redis.restart
    else:
        broker_url = settings.RABBITMQ_URL
        require_service("rabbitmq", broker_url)
        restart = rabbitmq_restart if os.environ.get("IO_CHAOS_RESTART_RABBITMQ") == "1" else None
    current_app.conf.broker_url = broker_url
    current_app.conf.task_default_queue = queue
    reset_broker_pools()
    return broker_url, restart


def _run(broker: str, load: Load, private_redis: RedisServer, *, batches: bool = False) -> None:
    seed = _env_int("IO_CHAOS_SEED", random.randrange(2**32))
    rng = random.Random(seed)
    queue = f"io-chaos-{uuid.uuid4().hex[:10]}"
    broker_url, restart = chaos_broker(broker, private_redis, queue)

    orders = make_orders(load.orders)
    stream = build_stream(orders, rng=rng, max_copies=load.max_copies)
    env = worker_env(
        broker_url=broker_url,
        queue=queue,
        settings_module="tests.chaos_settings",
        IO_TEST_REDIS_URL=private_redis.db_url(1),
    )
    workers: Workers
    if batches:
        # consume_orders_in_batches processes instead of Celery workers: a SIGKILL lands
        # mid-batch, whose deliveries are all unacknowledged.
        workers = BatchConsumers(broker_url, queue, env, batch_size=25, flush_interval=0.1)
        with current_app.connection_for_write() as conn:
            current_app.amqp.queues[queue].bind(conn.default_channel).declare()
    else:
        workers = Workers(broker_url=broker_url, queue=queue, env=env)
    workers.start(load.workers)
    ctx = ChaosContext(
        workers=workers, rng=rng, restart_broker=restart, flush_redis=private_redis.flushall
    )
    try:
        report = run_chaos(stream, ctx, broker=broker, schedule=schedule(load.kills))
    finally:
        workers.stop()
        if broker == "rabbitmq":
            try:
                with current_app.connection_for_write() as conn:
                    conn.default_channel.queue_delete(queue)
            except Exception:
                pass
    kind = "batch consumers" if batches else "celery workers"
    summary = f"{kind} seed={seed} {report.summary()}; faults: {'; '.join(report.faults)}"
    print(summary)
    if path := os.environ.get("IO_CHAOS_REPORT"):
        with open(path, "a") as out:
            out.write(json.dumps({"seed": seed, "summary": summary}) + "\n")
    assert not report.invariants.violations, (
        summary + "\n" + "\n".join(report.invariants.violations) + "\n" + workers.log_tail()
    )
    assert sum(1 for f in report.faults if f.startswith("SIGKILL")) >= 5
    assert ctx.terminated > 0, "the database fault hit no worker connection"


#: The RabbitMQ runs restart the shared broker when IO_CHAOS_RESTART_RABBITMQ=1 (CI): marked,
#: so that tests/support/matrix.py runs them while nothing else uses it.
RABBITMQ = pytest.param("rabbitmq", marks=pytest.mark.restarts_rabbitmq)


@pytest.mark.parametrize("broker", ["redis", RABBITMQ])
def test_exactly_once_under_faults(
    broker: str, transactional_db: None, private_redis: RedisServer, use_broker: None
) -> None:
    _run(broker, BOUNDED, private_redis)


@pytest.mark.slow
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_exactly_once_under_faults_long(
    broker: str, transactional_db: None, private_redis: RedisServer, use_broker: None
) -> None:
    _run(broker, LONG, private_redis)


@pytest.mark.restarts_rabbitmq
def test_batch_consumers_exactly_once_under_faults(
    transactional_db: None, private_redis: RedisServer, use_broker: None
) -> None:
    _run("rabbitmq", BOUNDED, private_redis, batches=True)


@pytest.mark.slow
def test_batch_consumers_exactly_once_under_faults_long(
    transactional_db: None, private_redis: RedisServer, use_broker: None
) -> None:
    _run("rabbitmq", LONG, private_redis, batches=True)
