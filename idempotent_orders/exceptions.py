"""Exceptions raised by idempotent_orders.

``django_fsm.TransitionNotAllowed`` is not wrapped: the conditional transition
primitive returns a :class:`~idempotent_orders.transitions.TransitionResult`
instead of raising it.
"""

from __future__ import annotations


class IdempotentOrdersError(Exception):
    """Base class of every exception this app raises."""

    default_code = "error"

    def __init__(self, message: str = "", *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code


class InvalidMessage(IdempotentOrdersError):
    """A message cannot be applied; the reason is recorded on its inbox row."""

    default_code = "invalid_message"


class UnknownTransition(IdempotentOrdersError):
    """A handler names a method that is not a django-fsm transition of the model."""

    default_code = "unknown_transition"


class ConcurrentUpdate(IdempotentOrdersError):
    """Optimistic-lock conflicts did not settle within ``CONFLICT_RETRIES``; retry later.

    Transient: the Celery tasks retry it with backoff like a lost connection.
    """

    default_code = "concurrent_update"


class LockError(IdempotentOrdersError):
    """Base class of distributed-lock errors."""

    default_code = "lock_error"


class LockNotAcquired(LockError):
    """Another holder kept the lock for the whole acquisition timeout."""

    default_code = "lock_not_acquired"


class LockUnavailable(LockError):
    """The lock service (Redis) cannot be reached: the guarded work must not run unguarded."""

    default_code = "lock_unavailable"


class LockLost(LockError):
    """The lock expired (or was taken over) before its holder released or extended it.

    Writes fenced with the holder's token were rejected if a newer holder wrote first.
    """

    default_code = "lock_lost"
