"""RabbitMQ quorum queues: a retried message does not block the worker (Celery's native
delayed delivery), and is applied once."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import current_app

from idempotent_orders import get_order_model
from idempotent_orders.models import InboxStatus, Outcome, ProcessedMessage
from tests.support.messages import payment
from tests.support.services import wait_until

#: The settings of docs/operations.md ("Quorum queues"), as tests/settings.py sets them for
#: the worker under IO_TEST_QUORUM=1; the publishing side declares the queue the same way.
QUORUM = {
    "task_create_missing_queue_type": "quorum",
    "task_create_missing_queue_exchange_type": "topic",
    "task_default_queue_type": "quorum",
    "task_default_exchange_type": "topic",
}
#: The retry of a message first delivered with this many retries behind it waits 2**5 s.
RETRIES_BEHIND = 5


def _forget_routing() -> None:
    for cached in ("queues", "default_queue", "default_exchange", "router"):
        current_app.amqp.__dict__.pop(cached, None)


@pytest.fixture
def quorum_publisher() -> Iterator[None]:
    before = {key: current_app.conf.get(key) for key in QUORUM}
    current_app.conf.update(QUORUM)
    _forget_routing()
    yield
    current_app.conf.update(before)
    _forget_routing()


def _row(message: dict[str, Any]) -> ProcessedMessage | None:
    return ProcessedMessage.objects.filter(
        consumer="payments", message_id=message["message_id"]
    ).first()


@pytest.mark.workers
@pytest.mark.heavy
@pytest.mark.backends("postgresql")  # the broker is under test, not the database
def test_a_retry_on_a_quorum_queue_waits_in_the_broker_and_applies_once(
    celery_workers: Any, quorum_publisher: None, make_order: Any, tmp_path: Any
) -> None:
    from idempotent_orders.tasks import publish

    switch = tmp_path / "switch"
    switch.write_text("broken")
    # One worker process with one pool process: an ETA task held by the worker would
    # block it (a quorum queue takes no global prefetch), so nothing else would run.
    workers = celery_workers(
        "rabbitmq",
        processes=1,
        concurrency=1,
        extra_env={"IO_POISON_SWITCH": str(switch), "IO_TEST_QUORUM": "1"},
    )
    poisoned = make_order(business_key=f"poison-{uuid.uuid4().hex}")
    first = payment(poisoned)
    publish(first, consumer="payments", retries=RETRIES_BEHIND)
    assert wait_until(
        lambda: (row := _row(first)) is not None and row.status == InboxStatus.FAILED, timeout=90
    ), workers.log_tail()

    # While its retry waits (2**5 s), other payments are applied by the same worker.
    others = [payment(make_order()) for _ in range(3)]
    for message in others:
        publish(message, consumer="payments")
    assert wait_until(
        lambda: all(
            (row := _row(m)) is not None and row.status == InboxStatus.DONE for m in others
        ),
        timeout=2**RETRIES_BEHIND - 8,
    ), workers.log_tail()
    row = _row(first)
    assert row is not None
    assert (row.status, row.attempts) == (InboxStatus.FAILED, 1), "the retry ran before it was due"

    switch.write_text("fixed")
    assert wait_until(
        lambda: (row := _row(first)) is not None and row.status == InboxStatus.DONE, timeout=120
    ), workers.log_tail()
    applied = _row(first)
    assert applied is not None
    assert (applied.outcome, applied.attempts) == (Outcome.APPLIED, 2)
    assert get_order_model()._default_manager.get(pk=poisoned.pk).version == 1
    assert _queue_type(workers.queue) == "quorum"
    assert _exchange_exists("celery_delayed_27")  # the top level of Celery's delay exchanges


def _queue_type(name: str) -> str:
    """``quorum`` if the broker refuses to see queue ``name`` as a classic one."""
    from amqp.exceptions import PreconditionFailed

    with current_app.connection_for_write() as conn:
        channel = conn.channel()
        try:
            channel.queue_declare(name, durable=True, arguments={"x-queue-type": "classic"})
        except PreconditionFailed:
            return "quorum"
        finally:
            with contextlib.suppress(Exception):
                channel.close()
    return "classic"


def _exchange_exists(name: str) -> bool:
    from amqp.exceptions import NotFound

    with current_app.connection_for_write() as conn:
        channel = conn.channel()
        try:
            channel.exchange_declare(name, "topic", passive=True)
        except NotFound:
            return False
        with contextlib.suppress(Exception):
            channel.close()
    return True
