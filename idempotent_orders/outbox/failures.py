"""What a failed publish does: the broker breaker, the row's backoff, its dead letter.

A transport error (the broker unreachable) trips the process's :data:`breaker`
and keeps the row pending, its attempts untouched; any other error counts an
attempt, backs the row off (:func:`_backoff`) and, past
``OUTBOX_MAX_ATTEMPTS`` or on :class:`PermanentPublishError`, dead-letters it
(``outbox_dead``). The relay (:mod:`~idempotent_orders.outbox.relay`) calls
:func:`_failed` for each failed row.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta

from django.utils import timezone
from kombu.exceptions import OperationalError as KombuOperationalError

from idempotent_orders.conf import conf
from idempotent_orders.exceptions import PermanentPublishError
from idempotent_orders.models import OutboxMessage, OutboxStatus
from idempotent_orders.signals import outbox_dead

try:  # py-amqp (RabbitMQ): its connection errors are not all OSErrors
    from amqp.exceptions import RecoverableConnectionError as _AmqpRecoverable

    _AMQP_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (_AmqpRecoverable,)
except ImportError:  # pragma: no cover
    _AMQP_CONNECTION_ERRORS = ()

logger = logging.getLogger("idempotent_orders")


def _backoff(attempts: int) -> timedelta:
    return timedelta(seconds=min(conf.OUTBOX_RETRY_BACKOFF_MAX, 2 ** min(attempts, 20)))


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the broker could not be reached (not that it refused the row)."""
    if isinstance(exc, PermanentPublishError):
        return False
    if isinstance(exc, ConnectionError | TimeoutError | socket.gaierror | KombuOperationalError):
        return True
    recoverable = _AMQP_CONNECTION_ERRORS
    return bool(recoverable) and isinstance(exc, recoverable)


class Breaker:
    """The relay's circuit breaker for broker outages (one per process).

    A transport error opens it: publishing pauses (the rows stay pending, their
    attempts untouched), an error is logged once per outage, and the pause
    doubles up to :attr:`MAX_PAUSE` while the broker stays away (so the relay
    probes it at least that often, and resumes within that time of its return). The
    first publish after the pause is the probe: a success closes the breaker.
    An outage therefore never spends a row's dead-letter budget.
    """

    #: The longest pause, in seconds (``OUTBOX_RETRY_BACKOFF_MAX`` when that is shorter).
    MAX_PAUSE = 15

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.failures = 0
        self.open_until = 0.0
        self.opened_at: float | None = None

    def paused(self) -> bool:
        return time.monotonic() < self.open_until

    def reset(self) -> None:
        """Closed, with no history (tests; a process that knows the broker is back)."""
        with self._lock:
            self.failures, self.open_until, self.opened_at = 0, 0.0, None

    def trip(self, exc: BaseException) -> float:
        """Open (or keep open) the breaker; the pause, in seconds."""
        with self._lock:
            self.failures += 1
            cap = min(conf.OUTBOX_RETRY_BACKOFF_MAX, self.MAX_PAUSE)
            pause = float(min(cap, 2 ** min(self.failures, 20)))
            self.open_until = time.monotonic() + pause
            first = self.opened_at is None
            if first:
                self.opened_at = time.monotonic()
        if first:
            logger.error(
                "outbox: the broker is unreachable (%r); publishing paused, rows kept pending",
                exc,
            )
        return pause

    def close(self) -> None:
        if self.opened_at is None and not self.failures:
            return
        with self._lock:
            down = time.monotonic() - (self.opened_at or time.monotonic())
            self.failures, self.open_until, self.opened_at = 0, 0.0, None
        logger.warning("outbox: the broker is back after %.0fs; publishing resumed", down)


breaker = Breaker()


def _failed(db: str, row: OutboxMessage, exc: Exception) -> bool:
    """Record a failed publish of ``row``: back off, or dead-letter it; True if dead.

    A transport error (the broker unreachable) trips the :data:`breaker` and keeps
    the row pending with its attempts as they were: only errors of the row's own
    count towards ``OUTBOX_MAX_ATTEMPTS``.
    """
    if is_transport_error(exc):
        pause = breaker.trip(exc)
        row.claimed_until = None
        row.last_error = f"broker unreachable: {type(exc).__name__}: {exc}"[:2000]
        row.available_at = timezone.now() + timedelta(seconds=pause)
        OutboxMessage.objects.using(db).filter(pk=row.pk).update(
            available_at=row.available_at, claimed_until=None, last_error=row.last_error
        )
        return False
    row.attempts += 1
    row.claimed_until = None
    row.last_error = f"{type(exc).__name__}: {exc}"[:2000]
    permanent = isinstance(exc, PermanentPublishError)
    rows = OutboxMessage.objects.using(db).filter(pk=row.pk)
    if permanent or row.attempts >= conf.OUTBOX_MAX_ATTEMPTS:
        row.status = OutboxStatus.DEAD
        row.dead_at = timezone.now()
        rows.update(
            status=row.status,
            attempts=row.attempts,
            claimed_until=None,
            last_error=row.last_error,
            dead_at=row.dead_at,
        )
        logger.error(
            "outbox: %s dead-lettered after %d attempt(s)%s: %r",
            row.message_id,
            row.attempts,
            " (permanent error)" if permanent else "",
            exc,
            extra={"message_id": row.message_id},
        )
        outbox_dead.send(
            sender=OutboxMessage,
            message_id=row.message_id,
            task_name=row.task_name,
            attempts=row.attempts,
            error=row.last_error,
        )
        return True
    row.available_at = timezone.now() + _backoff(row.attempts)
    rows.update(
        attempts=row.attempts,
        available_at=row.available_at,
        claimed_until=None,
        last_error=row.last_error,
    )
    logger.warning(
        "outbox: publishing %s failed (attempt %d of %d): %r",
        row.message_id,
        row.attempts,
        conf.OUTBOX_MAX_ATTEMPTS,
        exc,
        extra={"message_id": row.message_id},
    )
    return False
