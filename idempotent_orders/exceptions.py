"""Exceptions raised by idempotent_orders.

``django_fsm.TransitionNotAllowed`` is not wrapped: the conditional transition
primitive returns a :class:`~idempotent_orders.consuming.graph.TransitionResult`
instead of raising it.
"""

from __future__ import annotations

from celery.exceptions import Ignore


class IdempotentOrdersError(Exception):
    """Base class of every exception this app raises.

    ``code`` is a stable, kebab-case name of the error (the HTTP errors use it
    as the last segment of their problem type, ``urn:idempotent-orders:<code>``).
    """

    default_code = "error"

    def __init__(self, message: str = "", *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code


class InvalidMessage(IdempotentOrdersError):
    """A message cannot be applied; the reason is recorded on its inbox row."""

    default_code = "invalid-message"


class UnknownTransition(IdempotentOrdersError):
    """A handler names a method that is not a django-fsm transition of the model."""

    default_code = "unknown-transition"


class TransactionAborted(IdempotentOrdersError):
    """The message's transaction was aborted by a database error that the project's code
    caught (a receiver, a body, a ``save()`` override): nothing of the message can commit,
    and it is kept as failed instead of being reported applied."""

    default_code = "transaction-aborted"


class OrderChanged(Exception):
    """The guarded ``save()`` of a transition found the order changed since it was read.

    Raised from the order model's ``_do_update`` when the ``UPDATE`` that ``save()``
    sends matches no row with the state and ``version`` read; the consumer rolls back,
    reads the order again and decides again. Never reaches the project's code.
    """


class TransitionNotSaved(IdempotentOrdersError):
    """The model's own ``save()`` returned without writing the order (it never called
    ``super().save()``), so a transition a message applied was not committed. The
    message is kept as failed with this reason, never recorded as applied."""

    default_code = "transition-not-saved"


class ConcurrentUpdate(IdempotentOrdersError):
    """Optimistic-lock conflicts did not settle within ``CONFLICT_RETRIES``; retry later.

    Transient: the Celery tasks retry it with backoff like a lost connection.
    """

    default_code = "concurrent-update"


class LockError(IdempotentOrdersError):
    """Base class of distributed-lock errors."""

    default_code = "lock-error"


class LockNotAcquired(LockError):
    """Another holder kept the lock for the whole acquisition timeout."""

    default_code = "lock-not-acquired"


class LockUnavailable(LockError):
    """The lock service (Redis) cannot be reached: the guarded work must not run unguarded."""

    default_code = "lock-unavailable"


class LockLost(LockError):
    """The lock expired (or was taken over) before its holder released or extended it.

    Writes fenced with the holder's token were rejected if a newer holder wrote first.
    """

    default_code = "lock-lost"


class IdempotencyError(IdempotentOrdersError):
    """An HTTP request cannot run under its idempotency key; answered as problem+json.

    ``status_code`` is the HTTP status, ``code`` the problem type's last segment,
    ``retry_after`` (seconds) adds a ``Retry-After`` header when set.
    """

    status_code = 400
    default_code = "idempotency-error"
    title = "Idempotency error"

    def __init__(
        self, message: str = "", *, code: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class KeyMissing(IdempotencyError):
    status_code = 400
    default_code = "key-missing"
    title = "Idempotency-Key required"


class KeyInvalid(IdempotencyError):
    status_code = 400
    default_code = "key-invalid"
    title = "Malformed Idempotency-Key"


class NotAuthenticated(IdempotencyError):
    status_code = 401
    default_code = "not-authenticated"
    title = "Authentication required"


class SessionRequired(NotAuthenticated):
    """An anonymous caller sent a key without a session: its key would protect nothing
    (each such request would be a new principal), so it is refused."""

    default_code = "session-required"
    title = "A session is required"


class TokenInvalid(IdempotencyError):
    status_code = 403
    default_code = "token-invalid"
    title = "Unknown, expired or foreign token"


class KeyInFlight(IdempotencyError):
    status_code = 409
    default_code = "key-in-flight"
    title = "A request with this key is still being processed"


class BodyTooLarge(IdempotencyError):
    status_code = 413
    default_code = "body-too-large"
    title = "Request body too large"


class KeyMismatch(IdempotencyError):
    status_code = 422
    default_code = "key-mismatch"
    title = "Idempotency-Key reused with a different request"


class QuotaExceeded(IdempotencyError):
    status_code = 429
    default_code = "quota-exceeded"
    title = "Too many idempotency keys or tokens"


class TooManySessions(QuotaExceeded):
    """Past ``SESSION_RATE`` new anonymous sessions from one client IP in its window."""

    default_code = "too-many-sessions"
    title = "Too many new sessions from this address"


class CallInProgress(IdempotentOrdersError):
    """An ``@idempotent(external=True)`` call with this key holds a lease, or waits for the
    reconciler after its lease expired; it is finished there, not by this caller.

    Transient: retry later (a Celery task can list it in ``autoretry_for``).
    """

    default_code = "call-in-progress"


class CallFailed(IdempotentOrdersError):
    """An ``@idempotent(external=True)`` call was marked failed for an operator."""

    default_code = "call-failed"


class PermanentPublishError(IdempotentOrdersError):
    """Raised while the outbox relay publishes a row (by the task's own ``apply_async``,
    for instance a ``Task`` subclass that validates its message): the message can never
    be published, so the row is dead-lettered at once instead of retried. (Celery logs
    and ignores exceptions of ``before_task_publish`` receivers: they cannot stop it.)

    Also importable as ``idempotent_orders.outbox.PermanentPublishError``.
    """

    default_code = "permanent-publish-error"


class PermanentFailure(IdempotentOrdersError):
    """Raised by ``@idempotent`` work that can never succeed for this message (bad data,
    a deleted object): the run rolls back and its inbox row is dead at once, instead of
    running again on every delivery up to ``IDEMPOTENT_MAX_ATTEMPTS``. (The decorator's
    ``permanent=(ExcType, ...)`` names more exception types that do the same.)
    """

    default_code = "permanent-failure"


class MessageDead(IdempotentOrdersError, Ignore):
    """An ``@idempotent`` message is dead: its work failed ``IDEMPOTENT_MAX_ATTEMPTS``
    times or permanently, and it does not run again until an operator requeues it.

    Raised by the run that makes the row dead (chained from the work's exception)
    and by every later delivery, which does not run the work. It is also Celery's
    ``Ignore``: a task that raises it is acknowledged and never retried, not even
    by ``autoretry_for=(Exception,)``; the inbox row is the record.
    """

    default_code = "message-dead"
