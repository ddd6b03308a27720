"""Celery tasks: thin wrappers around the consumer (:mod:`idempotent_orders.consuming.single`)."""

from __future__ import annotations

import logging
from typing import Any

from celery import Task, shared_task
from celery.signals import worker_ready

from idempotent_orders import liveness
from idempotent_orders.conf import conf
from idempotent_orders.consuming.failures import TRANSIENT, MessageFailed, dead_letter
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import Outcome

#: What a consuming task returns for a message that failed its last retry.
DEAD = "dead"

logger = logging.getLogger("idempotent_orders")

#: Errors worth a retry: the message may apply once the connection or the race settles.
#: Business rejections never raise, so they are never retried.
TRANSIENT_ERRORS = TRANSIENT

#: Options every consuming task carries: a message is acknowledged only after
#: its transaction committed, and goes back to the queue if the worker dies.
CONSUMER_TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "acks_late": True,
    "reject_on_worker_lost": True,
}


def _consume(task: Task, message: Any, consumer: str) -> str:
    try:
        return consume_message(message, consumer=consumer).value
    except MessageFailed as exc:
        return _failed(task, exc)
    except TRANSIENT_ERRORS as exc:
        retries = task.request.retries
        countdown = min(conf.TASK_RETRY_BACKOFF_MAX, 2**retries)
        logger.warning(
            "transient error consuming %s, retry %d in %ss: %r",
            message.get("message_id") if isinstance(message, dict) else None,
            retries + 1,
            countdown,
            exc,
        )
        raise task.retry(exc=exc, countdown=countdown, max_retries=conf.TASK_MAX_RETRIES) from exc


def _failed(task: Task, failure: MessageFailed) -> str:
    """Retry a failed message with backoff; after the last retry it becomes a dead letter.

    The failed inbox row (with the envelope and why) was committed before this
    runs, so whatever happens to the task, the message is kept.
    """
    retries = task.request.retries
    if retries >= conf.TASK_MAX_RETRIES:
        dead_letter(failure.consumer, failure.message_id)
        logger.error(
            "message %s (%s) is a dead letter after %d attempts: %s",
            failure.message_id,
            failure.consumer,
            retries + 1,
            failure.reason,
        )
        return DEAD
    countdown = min(conf.TASK_RETRY_BACKOFF_MAX, 2**retries)
    raise task.retry(exc=failure, countdown=countdown, max_retries=conf.TASK_MAX_RETRIES)


@shared_task(name="idempotent_orders.consume_payment", **CONSUMER_TASK_OPTIONS)
def consume_payment(self: Task, message: Any) -> str:
    """Consume a ``payment.*`` (or ``order.cancelled``) message; returns the outcome value."""
    return _consume(self, message, "payments")


@shared_task(name="idempotent_orders.consume_shipping", **CONSUMER_TASK_OPTIONS)
def consume_shipping(self: Task, message: Any) -> str:
    """Consume a ``shipment.*`` message; returns the outcome value."""
    return _consume(self, message, "shipping")


@shared_task(name="idempotent_orders.fulfil_order", **CONSUMER_TASK_OPTIONS)
def fulfil_order(self: Task, order_id: int) -> str:
    """Call the warehouse and move a paid order to ``processing``, in three leased phases.

    Returns an outcome value, or ``retry``/``failed`` (see
    :func:`idempotent_orders.fulfilment.fulfil`). A failed warehouse call is not
    retried here: the row's lease is released and the reconciler verifies
    before calling again.
    """
    from idempotent_orders.fulfilment import fulfil

    try:
        return fulfil(order_id).value
    except TRANSIENT_ERRORS as exc:
        countdown = min(conf.TASK_RETRY_BACKOFF_MAX, 2**self.request.retries)
        error = exc if isinstance(exc, Exception) else None
        raise self.retry(exc=error, countdown=countdown, max_retries=conf.TASK_MAX_RETRIES) from exc


@shared_task(name="idempotent_orders.reconcile", acks_late=True, reject_on_worker_lost=True)
def reconcile() -> dict[str, int]:
    """One reconciler pass over expired leases (run it on Celery beat)."""
    from idempotent_orders.reconcile import reconcile as run

    actions = dict(run().actions)
    liveness.beat("reconciler")
    return actions


# Each worker process beats for the dashboard (idempotent_orders.liveness).
worker_ready.connect(
    liveness._on_worker_ready, weak=False, dispatch_uid="idempotent_orders.liveness"
)


@shared_task(name="idempotent_orders.purge", acks_late=True, reject_on_worker_lost=True)
def purge() -> dict[str, int]:
    """Delete rows older than their retention windows, in batches (run it on Celery beat)."""
    from idempotent_orders.retention import purge as run

    return run().as_dict()


def fulfilment_message(order_id: int) -> dict[str, Any]:
    """The internal message of the fulfilment step; its id makes the step run once per order."""
    return {
        "message_id": f"fulfil-{order_id}",
        "type": "order.fulfilment",
        "order_id": order_id,
        "payload": {},
    }


_TASKS = {"payments": consume_payment, "shipping": consume_shipping}
#: The consumers of the app's own Celery tasks (the admin's consumer filter lists them).
CONSUMERS = tuple(_TASKS)


def publish(message: dict[str, Any], *, consumer: str, **options: Any) -> None:
    """Send a message to its consumer's task with ``task_id = message_id``.

    The task id lets brokers and result backends recognise a re-publish of the
    same message; the inbox still decides duplicates.
    """
    try:
        task = _TASKS[consumer]
    except KeyError:
        raise ValueError(
            f"unknown consumer {consumer!r}; expected one of {sorted(_TASKS)}"
        ) from None
    task.apply_async(args=[message], task_id=str(message["message_id"]), **options)


@shared_task(name="idempotent_orders.relay_outbox", ignore_result=True)
def relay_outbox_task() -> dict[str, int]:
    """Publish pending outbox rows; schedule it with Celery beat (every few seconds)."""
    from dataclasses import asdict

    from idempotent_orders.outbox import relay_outbox

    return asdict(relay_outbox())


@shared_task(name="idempotent_orders.purge_outbox", ignore_result=True)
def purge_outbox_task() -> int:
    """Delete sent outbox rows older than ``OUTBOX_RETENTION``; schedule it daily."""
    from idempotent_orders.outbox import purge_outbox

    return purge_outbox()


@shared_task(name="idempotent_orders.surface_overdue_parked")
def surface_overdue_parked() -> int:
    """Periodic: release parked messages that can go ahead, mark those that waited too long."""
    from idempotent_orders.consuming.single import surface_overdue_parked as surface

    return len(surface())


@shared_task(name="idempotent_orders.consume_batch", **CONSUMER_TASK_OPTIONS)
def consume_batch_task(self: Task, messages: list[Any], consumer: str) -> list[str]:
    """Consume a list of messages for ``consumer`` in one transaction; returns the outcome values.

    A transient error retries the whole batch: the inbox makes the retry see
    the messages a previous attempt committed as duplicates.
    """
    from idempotent_orders.consuming.batch import consume_batch

    try:
        outcomes = consume_batch(messages, consumer=consumer)
    except TRANSIENT_ERRORS as exc:
        retries = self.request.retries
        countdown = min(conf.TASK_RETRY_BACKOFF_MAX, 2**retries)
        logger.warning(
            "transient error consuming a batch of %d, retry %d in %ss: %r",
            len(messages),
            retries + 1,
            countdown,
            exc,
        )
        raise self.retry(exc=exc, countdown=countdown, max_retries=conf.TASK_MAX_RETRIES) from exc
    failed = [
        str(message.get("message_id"))
        for message, outcome in zip(messages, outcomes, strict=True)
        if outcome is Outcome.FAILED and isinstance(message, dict)
    ]
    if failed:
        # The rest committed; the inbox makes them duplicates on the retry, which
        # runs the failed ones again (their rows are kept as failed meanwhile).
        retries = self.request.retries
        if retries < conf.TASK_MAX_RETRIES:
            countdown = min(conf.TASK_RETRY_BACKOFF_MAX, 2**retries)
            raise self.retry(countdown=countdown, max_retries=conf.TASK_MAX_RETRIES)
        for message_id in failed:
            dead_letter(consumer, message_id)
    return [DEAD if o is Outcome.FAILED else o.value for o in outcomes]


@shared_task(name="idempotent_orders.consume_webhook_event", **CONSUMER_TASK_OPTIONS)
def consume_webhook_event(self: Task, message: dict[str, Any]) -> str:
    """Consume a stored webhook event (``message["event"]`` is its pk) through the inbox.

    Queued through the outbox by the webhook view, in the transaction that stored
    the event. A failure is retried with backoff and dead-lettered at last, as
    for any consumed message; the event row says ``failed`` meanwhile.
    """
    from idempotent_orders.webhooks.ingress import process_event

    try:
        return process_event(int(message["event"])) or "failed"
    except MessageFailed as exc:
        return _failed(self, exc)
    except TRANSIENT_ERRORS as exc:
        countdown = min(conf.TASK_RETRY_BACKOFF_MAX, 2**self.request.retries)
        raise self.retry(exc=exc, countdown=countdown, max_retries=conf.TASK_MAX_RETRIES) from exc


@shared_task(name="idempotent_orders.fire_due_timers", acks_late=True, reject_on_worker_lost=True)
def fire_due_timers() -> dict[str, int]:
    """Periodic: fire the durable timers that are due (run it on Celery beat, every few seconds).

    Several beats or workers may run it at once: a timer's message id is fixed,
    so the inbox applies each timer once.
    """
    from collections import Counter

    from idempotent_orders.timers import fire_due

    return dict(Counter(outcome for _, outcome in fire_due()))
