"""Leased work with an effect outside the database: claim, heartbeat, fenced completion.

A step that calls another system (a warehouse, a payment provider) cannot share
the database transaction, so it runs in three phases on its inbox row
(:class:`~idempotent_orders.models.ProcessedMessage`, unique per
``(consumer, message_id)``):

1. :func:`claim` inserts the row as ``processing`` with a lease
   (``lease_expires_at``), a heartbeat and a *fencing token* (for orders, the
   order's ``version`` when the work was decided). The unique index decides who
   runs; a row whose lease expired can be taken over, and the taker is told so
   (``Lease.resumed``) because the effect may already have happened.
2. The caller performs the effect with :attr:`Lease.idempotency_key`, a key
   derived from the message id, while :func:`heartbeating` keeps the lease alive.
3. :func:`complete` marks the row ``done`` with a conditional UPDATE that only
   succeeds for this claim (same token, same claim generation), together with
   the caller's own database change, in one transaction.

A worker that dies between 1 and 3 leaves a ``processing`` row whose lease
expires; :func:`run_step` (used by the task and by the reconciler) verifies
such rows before acting again, so the outside system sees the effect once.

The reusable surface is :func:`idempotency_key`, :func:`claim`,
:func:`heartbeat`, :func:`heartbeating`, :func:`complete`, :func:`release`,
:func:`fail`, :class:`LeasedStep`, :func:`register_step` and :func:`run_step`.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, connection, transaction
from django.db.models import F, QuerySet
from django.utils import timezone

from idempotent_orders.conf import conf
from idempotent_orders.models import AbstractOrder, InboxStatus, Outcome, ProcessedMessage
from idempotent_orders.signals import lease_finished

__all__ = [
    "ClaimOutcome",
    "ClaimState",
    "Lease",
    "LeasedStep",
    "StepResult",
    "Verification",
    "claim",
    "complete",
    "expired",
    "fail",
    "get_step",
    "heartbeat",
    "heartbeating",
    "idempotency_key",
    "register_step",
    "release",
    "run_step",
    "takeover",
]

logger = logging.getLogger("idempotent_orders")


def idempotency_key(consumer: str, message_id: str) -> str:
    """The key sent to the other system for ``(consumer, message_id)``.

    Deterministic (every retry, every worker, the reconciler send the same key),
    bounded (72 characters whatever the message id) and opaque (no message id
    leaks to the other system).
    """
    digest = hashlib.sha256(f"{consumer}\x00{message_id}".encode()).hexdigest()
    return f"io1-{digest}"


@dataclass(frozen=True)
class Lease:
    """A claim on one inbox row, valid while the row still carries this token and attempt."""

    pk: int
    consumer: str
    message_id: str
    #: Fencing token: the order version (or any integer the caller chose) the work was decided at.
    token: int
    #: Claim generation (the row's ``attempts`` at claim time); a takeover increments it.
    attempt: int
    expires_at: datetime
    #: Taken over from an expired lease: the effect may have happened, verify first.
    resumed: bool
    order_id: int | None = None

    @property
    def idempotency_key(self) -> str:
        return idempotency_key(self.consumer, self.message_id)

    @property
    def stalls(self) -> int:
        """How many earlier claims on this row expired without completing."""
        return self.attempt - 1

    def log_extra(self) -> dict[str, object]:
        return {"message_id": self.message_id, "order_id": self.order_id}


class ClaimState(enum.Enum):
    #: The lease is yours (``ClaimOutcome.lease`` is set).
    CLAIMED = "claimed"
    #: The row is final already (done or rejected): nothing to do.
    DONE = "done"
    #: Someone else holds a live lease.
    BUSY = "busy"
    #: The row was marked failed for an operator.
    FAILED = "failed"


@dataclass(frozen=True)
class ClaimOutcome:
    """What :func:`claim` got: its state, the lease when ``CLAIMED``, and the inbox row."""

    state: ClaimState
    lease: Lease | None = None
    row: ProcessedMessage | None = None


def _lease_for(row: ProcessedMessage, *, resumed: bool) -> Lease:
    assert row.lease_expires_at is not None
    assert row.fencing_token is not None
    return Lease(
        pk=row.pk,
        consumer=row.consumer,
        message_id=row.message_id,
        token=row.fencing_token,
        attempt=row.attempts,
        expires_at=row.lease_expires_at,
        resumed=resumed,
        order_id=row.order_id,
    )


def _ttl(ttl: float | None) -> timedelta:
    return timedelta(seconds=conf.LEASE_SECONDS if ttl is None else ttl)


def claim(
    *,
    consumer: str,
    message_id: str,
    token: int,
    order: AbstractOrder | None = None,
    message_type: str = "",
    ttl: float | None = None,
    allow_takeover: bool = True,
    body: str = "",
) -> ClaimOutcome:
    """Claim ``(consumer, message_id)`` for leased work; never blocks.

    Inserts the inbox row as ``processing``. When the row exists: a final row
    gives ``DONE``, a failed one ``FAILED``, a live lease ``BUSY``, and an
    expired lease is taken over (``allow_takeover``) with a conditional UPDATE,
    giving a ``CLAIMED`` lease with ``resumed=True``: the caller must verify
    whether the effect happened before doing it again (:func:`run_step` does).
    ``body`` is stored on a new row: what a later attempt needs to perform again.
    """
    now = timezone.now()
    try:
        with transaction.atomic():
            row = ProcessedMessage.objects.create(
                consumer=consumer,
                message_id=message_id,
                message_type=message_type,
                status=InboxStatus.PROCESSING,
                outcome="",
                order_id=order.pk if order is not None else None,
                attempts=1,
                lease_expires_at=now + _ttl(ttl),
                heartbeat_at=now,
                fencing_token=token,
                body=body,
            )
    except IntegrityError:
        pass
    else:
        lease = _lease_for(row, resumed=False)
        logger.info("claimed %s (%s)", message_id, consumer, extra=lease.log_extra())
        return ClaimOutcome(ClaimState.CLAIMED, lease, row)

    row = ProcessedMessage.objects.get(consumer=consumer, message_id=message_id)
    if row.status == InboxStatus.FAILED:
        return ClaimOutcome(ClaimState.FAILED, row=row)
    if row.status != InboxStatus.PROCESSING:
        return ClaimOutcome(ClaimState.DONE, row=row)
    if not allow_takeover:
        return ClaimOutcome(ClaimState.BUSY, row=row)
    taken = takeover(row, ttl=ttl)
    if taken is None:
        return ClaimOutcome(ClaimState.BUSY, row=row)
    return ClaimOutcome(ClaimState.CLAIMED, taken, row)


def takeover(
    row: ProcessedMessage, *, ttl: float | None = None, force: bool = False
) -> Lease | None:
    """Take over ``row``'s expired lease (``force``: even a live one); None if someone else won.

    One conditional UPDATE on ``(status, attempts, lease_expires_at)``: of any
    number of workers and reconcilers trying at once, exactly one succeeds, and
    the previous holder's :func:`heartbeat` and :func:`complete` fail from then on.
    The fencing token is kept: it names the state the work was decided at.
    """
    now = timezone.now()
    rows = ProcessedMessage.objects.filter(
        pk=row.pk, status=InboxStatus.PROCESSING, attempts=row.attempts
    )
    if not force:
        rows = rows.filter(lease_expires_at__lt=now)
    expires = now + _ttl(ttl)
    # The reason of the attempt before is its own (kept in its LeaseAttempt): this one
    # starts without one, so a lease that runs out with no word reads as a stall.
    if (
        rows.update(
            attempts=F("attempts") + 1, lease_expires_at=expires, heartbeat_at=now, error=""
        )
        != 1
    ):
        return None
    row.attempts += 1
    row.lease_expires_at = expires
    row.heartbeat_at = now
    if row.fencing_token is None:  # a row claimed by an older version of the code
        row.fencing_token = 0
    lease = _lease_for(row, resumed=True)
    logger.info(
        "took over %s (%s), stall %d",
        row.message_id,
        row.consumer,
        lease.stalls,
        extra=lease.log_extra(),
    )
    return lease


def _fenced(lease: Lease) -> QuerySet[ProcessedMessage]:
    return ProcessedMessage.objects.filter(
        pk=lease.pk,
        status=InboxStatus.PROCESSING,
        attempts=lease.attempt,
        fencing_token=lease.token,
    )


def heartbeat(lease: Lease, *, ttl: float | None = None) -> bool:
    """Extend the lease; False when it was lost (taken over, completed or failed elsewhere)."""
    now = timezone.now()
    return _fenced(lease).update(lease_expires_at=now + _ttl(ttl), heartbeat_at=now) == 1


@contextmanager
def heartbeating(lease: Lease, *, every: float | None = None) -> Iterator[threading.Event]:
    """Extend ``lease`` from a background thread while the block runs.

    Yields an event that is set if the lease is lost meanwhile; the block's
    result must then not be trusted to complete (:func:`complete` would refuse
    anyway). The thread uses its own database connection and closes it.
    """
    interval = conf.HEARTBEAT_SECONDS if every is None else every
    stop = threading.Event()
    lost = threading.Event()

    def beat() -> None:
        try:
            while not stop.wait(interval):
                try:
                    if not heartbeat(lease):
                        lost.set()
                        return
                except Exception:  # a flaky connection: try again at the next beat
                    logger.warning("heartbeat failed", exc_info=True, extra=lease.log_extra())
        finally:
            connection.close()

    thread = threading.Thread(target=beat, name=f"lease-{lease.pk}", daemon=True)
    thread.start()
    try:
        yield lost
    finally:
        stop.set()
        thread.join()


def complete(
    lease: Lease,
    *,
    outcome: Outcome | str = Outcome.APPLIED,
    status: InboxStatus = InboxStatus.DONE,
    error: str = "",
    apply: Callable[[], bool] | None = None,
) -> bool:
    """Finish the leased row, only if this lease still holds it; False otherwise.

    In one transaction: the fenced UPDATE of the inbox row, then ``apply()``,
    the caller's own conditional write (for orders, the transition at the
    fencing token's version). If ``apply()`` returns False everything is rolled
    back and the row stays ``processing`` under this lease.
    """
    with transaction.atomic():
        now = timezone.now()
        if (
            _fenced(lease).update(
                status=status,
                outcome=outcome,
                error=error,
                lease_expires_at=None,
                heartbeat_at=now,
                updated_at=now,
            )
            != 1
        ):
            return False
        if apply is not None and not apply():
            transaction.set_rollback(True)
            return False
    return True


def release(lease: Lease, *, error: str) -> bool:
    """Give the lease up now, keeping the row ``processing`` for a retry, with the reason."""
    now = timezone.now()
    return _fenced(lease).update(lease_expires_at=now, error=error[:2000], updated_at=now) == 1


def fail(row_pk: int, *, reason: str, attempt: int | None = None) -> bool:
    """Mark a ``processing`` row ``failed`` for an operator; False when it is not processing.

    With ``attempt``, only if no one claimed the row since (a fenced fail).
    """
    rows = ProcessedMessage.objects.filter(pk=row_pk, status=InboxStatus.PROCESSING)
    if attempt is not None:
        rows = rows.filter(attempts=attempt)
    now = timezone.now()
    return (
        rows.update(
            status=InboxStatus.FAILED,
            error=reason[:2000],
            lease_expires_at=None,
            updated_at=now,
        )
        == 1
    )


def expired(*, now: datetime | None = None) -> QuerySet[ProcessedMessage]:
    """``processing`` rows whose lease has run out, oldest first."""
    return ProcessedMessage.objects.filter(
        status=InboxStatus.PROCESSING, lease_expires_at__lt=now or timezone.now()
    ).order_by("lease_expires_at", "pk")


class Verification(enum.Enum):
    """What :meth:`LeasedStep.verify` found out about a leased effect."""

    #: The other system has the effect: complete without calling it again.
    DONE = "done"
    #: It certainly does not: calling it again is safe.
    NOT_DONE = "not_done"
    #: Cannot tell now (the other system is down): count a stall, try later.
    UNKNOWN = "unknown"


class StepResult(enum.Enum):
    COMPLETED = "completed"
    #: The effect was not confirmed; the row waits (expired lease) for the next attempt.
    RETRY = "retry"
    FAILED = "failed"
    #: Someone else holds or finished the row; this caller did nothing.
    SKIPPED = "skipped"


class LeasedStep(ABC):
    """A unit of leased work, registered per consumer with :func:`register_step`.

    The reconciler finds a consumer's expired rows and hands them to its step.
    """

    #: The inbox consumer name whose rows this step owns.
    consumer: str

    @abstractmethod
    def perform(self, lease: Lease) -> None:
        """Cause the effect in the other system with ``lease.idempotency_key``; raise on failure."""

    @abstractmethod
    def verify(self, lease: Lease) -> Verification:
        """Ask the other system whether the effect of ``lease`` happened."""

    @abstractmethod
    def finish(self, lease: Lease) -> StepResult:
        """Record the completed effect: usually :func:`complete` with a conditional write."""


_steps: dict[str, LeasedStep] = {}


def register_step(step: LeasedStep) -> LeasedStep:
    """Make ``step`` the owner of its consumer's leased rows (the reconciler uses it)."""
    _steps[step.consumer] = step
    return step


def step_consumers() -> list[str]:
    """The consumers a leased step is registered for (``fulfilment``, ...)."""
    return sorted(_steps)


def get_step(consumer: str) -> LeasedStep | None:
    return _steps.get(consumer)


#: A stalled attempt's answer (its lease ran out with no word from whoever held it).
STALLED = "its lease ran out with no word from whoever held it"


def _journal(lease: Lease, result: str, via: str, answer: str = "") -> None:
    """Keep this attempt and its answer (:class:`~idempotent_orders.models.LeaseAttempt`);
    a resumed lease first records the attempt before it as stalled when it left no word."""
    try:
        # A savepoint: a failed insert must not leave a caller's transaction broken.
        with transaction.atomic():
            _record_attempt(lease, result, via, answer)
    except Exception:  # the record of an attempt must never fail the attempt
        logger.warning(
            "could not record attempt %d", lease.attempt, extra=lease.log_extra(), exc_info=True
        )


def _record_attempt(lease: Lease, result: str, via: str, answer: str) -> None:
    from idempotent_orders.models import LeaseAttempt

    rows = LeaseAttempt.objects.filter(consumer=lease.consumer, message_id=lease.message_id)
    if lease.resumed and lease.attempt > 1 and not rows.filter(attempt=lease.attempt - 1).exists():
        LeaseAttempt.objects.create(
            consumer=lease.consumer,
            message_id=lease.message_id,
            order_id=lease.order_id,
            attempt=lease.attempt - 1,
            result="stalled",
            answer=STALLED,
        )
    LeaseAttempt.objects.create(
        consumer=lease.consumer,
        message_id=lease.message_id,
        order_id=lease.order_id,
        attempt=lease.attempt,
        via=via[:16],
        result=result,
        answer=answer[:2000],
    )


def _announce(lease: Lease, result: StepResult, via: str) -> None:
    lease_finished.send(
        sender=ProcessedMessage,
        consumer=lease.consumer,
        message_id=lease.message_id,
        order_id=lease.order_id,
        result=result.value,
        via=via,
        stalls=lease.stalls,
    )


def run_step(step: LeasedStep, lease: Lease, *, via: str = "worker") -> StepResult:
    """Phases 2 and 3 for a held lease: verify if resumed, perform, complete.

    A resumed lease is verified first: ``DONE`` completes without calling the
    other system, ``NOT_DONE`` performs again (same idempotency key),
    ``UNKNOWN`` releases the lease as a stall. An exception from ``perform``
    releases the lease with the error (the effect is unknown, so the next
    attempt verifies). Never raises for the other system's failures.
    """
    if lease.resumed:
        try:
            found = step.verify(lease)
        except Exception as exc:
            logger.warning("verification failed: %r", exc, extra=lease.log_extra())
            found = Verification.UNKNOWN
        if found is Verification.UNKNOWN:
            release(lease, error="the effect could not be verified")
            _journal(lease, "unverified", via, "the effect could not be verified")
            _announce(lease, StepResult.RETRY, via)
            return StepResult.RETRY
        if found is Verification.DONE:
            result = step.finish(lease)
            _journal(lease, result.value, via, "verified: the effect had happened")
            _announce(lease, result, via)
            return result
    try:
        with heartbeating(lease) as lost:
            step.perform(lease)
    except Exception as exc:
        logger.warning(
            "%s failed for %s: %r", step.consumer, lease.message_id, exc, extra=lease.log_extra()
        )
        release(lease, error=f"{type(exc).__name__}: {exc}"[:2000])
        _journal(lease, "refused", via, f"{type(exc).__name__}: {exc}")
        _announce(lease, StepResult.RETRY, via)
        return StepResult.RETRY
    if lost.is_set():
        # Someone took the row over while we worked; they verify and finish it.
        _journal(lease, "skipped", via, "taken over while it worked")
        _announce(lease, StepResult.SKIPPED, via)
        return StepResult.SKIPPED
    result = step.finish(lease)
    _journal(lease, result.value, via)
    _announce(lease, result, via)
    return result
