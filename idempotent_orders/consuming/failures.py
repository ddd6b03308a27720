"""Messages whose handling raised: kept, explained, retried, and dead-lettered at last.

An exception that is not a business outcome (a bug in a transition body, a
condition, a receiver or a validator; a constraint the database refused)
rolls the message's transaction back. What the consumer then writes, in a
transaction of its own, is a ``failed`` inbox row: the exception's class and
message, where it was raised, and the whole envelope, so that nothing of the
message is lost. A later delivery of the same message id is retried, not
counted as a duplicate; after ``TASK_MAX_RETRIES`` failed deliveries the row
becomes a dead letter (``dead``) that waits for an operator's requeue.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Iterable
from typing import Any

from django.db import IntegrityError, InterfaceError, OperationalError, transaction
from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from idempotent_orders.exceptions import ConcurrentUpdate, IdempotentOrdersError
from idempotent_orders.models import InboxStatus, ProcessedMessage
from idempotent_orders.vendors import vendor

__all__ = [
    "MessageFailed",
    "dead_letter",
    "describe",
    "failed_body",
    "log_failure",
    "record_failure",
    "redelivered",
    "retryable",
]

logger = logging.getLogger("idempotent_orders")

try:  # redis is installed with django-redis; the tuple just grows when it is there
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    _REDIS_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)
except ImportError:  # pragma: no cover
    _REDIS_ERRORS = ()

#: Errors after which the delivery is simply run again: nothing was written, and the
#: message may apply once the connection or the race settles. Never recorded as failed.
TRANSIENT: tuple[type[Exception], ...] = (
    OperationalError,  # lost connection, serialization failure, deadlock, lock timeout
    InterfaceError,
    ConcurrentUpdate,
    *_REDIS_ERRORS,
)

#: Inbox rows a new delivery of their message runs again: failed ones, and dead
#: ones an operator requeued (``processing`` without a lease or an outcome).
RETRYABLE = Q(status=InboxStatus.FAILED) | Q(
    status=InboxStatus.PROCESSING, lease_expires_at__isnull=True, outcome=""
)


def is_retryable(exc: Exception) -> bool:
    """Whether the database rolled the transaction back to break a race, and it may simply
    run again. Every vendor is asked: the error does not say which connection raised it."""
    return any(known.rolled_back(exc) for known in vendor.each())


class MessageFailed(IdempotentOrdersError):
    """Handling a message raised; its failed inbox row holds why. The cause is chained."""

    def __init__(self, consumer: str, message_id: str, reason: str, attempts: int) -> None:
        super().__init__(f"message {message_id} ({consumer}) failed: {reason}")
        self.consumer = consumer
        self.message_id = message_id
        self.reason = reason
        self.attempts = attempts


def describe(exc: BaseException) -> str:
    """``ValueError('...') at models.py:42 in pay``: the class, the message and where."""
    text = f"{type(exc).__name__}({str(exc)[:500]!r})"
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    if frames:
        last = frames[-1]
        where = last.filename.rsplit("/", 2)
        text += f" at {'/'.join(where[-2:])}:{last.lineno} in {last.name}"
    return text


def failed_body(envelope: dict[str, Any]) -> str:
    """What a failed inbox row keeps of its message: the whole envelope, as JSON."""
    return json.dumps(envelope, ensure_ascii=True, sort_keys=True, default=repr)


def log_failure(
    consumer: str, message_id: str, order_id: Any, attempts: int, reason: str, exc: BaseException
) -> None:
    """The error logged for a message kept as failed."""
    logger.error(
        "message %s (%s) failed (attempt %d): %s",
        message_id,
        consumer,
        attempts,
        reason,
        extra={"message_id": message_id, "order_id": order_id},
        exc_info=exc,
    )


def redelivered(consumer: str, message_ids: Iterable[str]) -> dict[str, tuple[bool | None, str]]:
    """What a new delivery of each of ``message_ids`` does, from its inbox row, and the
    row's fingerprint (ids without a row are left out). True: run it again (failed, or
    requeued by an operator: :data:`RETRYABLE`); None: it is a dead letter (not run, and
    not remembered as processed); False: it was handled.
    """
    rows = (
        ProcessedMessage.objects.filter(consumer=consumer, message_id__in=message_ids)
        .annotate(again=Case(When(RETRYABLE, then=Value(True)), default=Value(False)))
        .values_list("message_id", "status", "again", "fingerprint")
    )
    return {
        message_id: (None if status == InboxStatus.DEAD else bool(again), fingerprint)
        for message_id, status, again, fingerprint in rows
    }


def retryable(consumer: str, message_id: str) -> tuple[bool | None, str]:
    """:func:`redelivered` for one message (no row: ``(False, "")``)."""
    return redelivered(consumer, [message_id]).get(message_id, (False, ""))


def record_failure(
    consumer: str,
    *,
    message_id: str,
    message_type: str,
    order_id: Any,
    seq: int | None,
    envelope: dict[str, Any],
    exc: BaseException,
    fingerprint: str = "",
) -> MessageFailed:
    """Keep the message as ``failed`` with why, in its own transaction; the error to raise."""
    from idempotent_orders import get_order_model

    reason = describe(exc)
    body = failed_body(envelope)
    attempts = 1
    with transaction.atomic():
        exists = (
            order_id is not None and get_order_model()._default_manager.filter(pk=order_id).exists()
        )
        order = order_id if exists else None
        try:
            with transaction.atomic():
                ProcessedMessage.objects.create(
                    consumer=consumer,
                    message_id=message_id,
                    message_type=message_type,
                    status=InboxStatus.FAILED,
                    outcome="",
                    order_id=order,
                    seq=seq,
                    error=reason,
                    body=body,
                    fingerprint=fingerprint,
                )
        except IntegrityError:
            # A failed (or requeued) row from an earlier delivery: one more attempt.
            rows = ProcessedMessage.objects.filter(
                RETRYABLE, consumer=consumer, message_id=message_id
            )
            rows.update(
                status=InboxStatus.FAILED,
                attempts=F("attempts") + 1,
                error=reason,
                body=body,
                updated_at=timezone.now(),
            )
            attempts = (
                ProcessedMessage.objects.filter(consumer=consumer, message_id=message_id)
                .values_list("attempts", flat=True)
                .first()
                or 1
            )
    log_failure(consumer, message_id, order_id, attempts, reason, exc)
    return MessageFailed(consumer, message_id, reason, attempts)


def dead_letter(consumer: str, message_id: str) -> bool:
    """Make a failed message a dead letter (after its last retry); False if it is not failed."""
    return bool(
        ProcessedMessage.objects.filter(
            consumer=consumer, message_id=message_id, status=InboxStatus.FAILED
        ).update(status=InboxStatus.DEAD, dead_at=timezone.now(), updated_at=timezone.now())
    )
