"""The reconciler: finds leased work whose lease expired and completes, retries or fails it.

Run it periodically (the ``idempotent_orders.reconcile`` Celery task on beat)
or by hand (``manage.py reconcile_orders``). Any number may run at once: a row
is acted on only by whoever wins :func:`idempotent_orders.leases.takeover`, a
conditional UPDATE, and candidates are read with ``SKIP LOCKED`` where the
database has it so concurrent runs mostly pick different rows.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from django.db import connection, transaction
from django.utils import timezone

from idempotent_orders import leases
from idempotent_orders.conf import conf
from idempotent_orders.idempotent import load_step
from idempotent_orders.leases import Lease, StepResult
from idempotent_orders.models import InboxStatus, ProcessedMessage
from idempotent_orders.signals import message_reconciled

__all__ = ["ReconcileReport", "complete_if_verified", "reconcile", "reconcile_row", "retry"]

logger = logging.getLogger("idempotent_orders")


@dataclass
class ReconcileReport:
    """What one run did, by action (completed, retry, failed, skipped)."""

    actions: Counter[str] = field(default_factory=Counter)

    def __str__(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(self.actions.items())) or "nothing to do"


def _announce(row: ProcessedMessage, action: str) -> None:
    message_reconciled.send(
        sender=ProcessedMessage,
        consumer=row.consumer,
        message_id=row.message_id,
        order_id=row.order_id,
        action=action,
    )


#: How a given-up row's reason starts; a row given up again reads one reason, not a nest.
GAVE_UP = "gave up after "


def give_up_reason(attempts: int, error: str) -> str:
    """Why the reconciler stopped: the number of attempts and what the last one said.

    An attempt that was refused or failed (its step released the lease with an
    error) is named by that error; only a lease that ran out with no word from
    its worker is a stall. The previous give-up's own wording is not repeated.
    """
    while error.startswith(GAVE_UP) and "; last: " in error:
        error = error.split("; last: ", 1)[1]
    last = error or "its lease ran out with no word from the worker (a stall)"
    return f"{GAVE_UP}{attempts} attempts that did not finish; last: {last}"


def _give_up(row: ProcessedMessage) -> StepResult:
    reason = give_up_reason(row.attempts, row.error)
    if not leases.fail(row.pk, reason=reason, attempt=row.attempts):
        return StepResult.SKIPPED
    logger.error(
        "gave up on %s (%s): %s",
        row.message_id,
        row.consumer,
        reason,
        extra={"message_id": row.message_id, "order_id": row.order_id},
    )
    return StepResult.FAILED


def _act(row: ProcessedMessage, lease: Lease, via: str) -> StepResult:
    step = load_step(row)
    if step is None:
        leases.release(lease, error=f"no leased step is registered for {row.consumer!r}")
        return StepResult.RETRY
    return leases.run_step(step, lease, via=via)


def reconcile_row(
    row: ProcessedMessage, *, via: str = "reconciler", force: bool = False
) -> StepResult:
    """Handle one ``processing`` row whose lease expired (``force``: even a live one).

    After ``RECONCILE_MAX_STALLS`` expired claims the row is marked ``failed``
    (unless ``force``, an operator's retry); otherwise the lease is taken over
    and the consumer's step verifies, then completes or performs again. Rows of
    a consumer without a registered step are released and, after the same
    number of stalls, failed, since nothing can verify them.
    """
    if not force and row.attempts > conf.RECONCILE_MAX_STALLS:
        result = _give_up(row)
    else:
        lease = leases.takeover(row, force=force)
        result = StepResult.SKIPPED if lease is None else _act(row, lease, via)
    _announce(row, result.value)
    return result


def reconcile(*, limit: int | None = None, now: datetime | None = None) -> ReconcileReport:
    """One pass over at most ``limit`` (``RECONCILE_BATCH_SIZE``) expired leases.

    The batch is chosen and taken over in one short transaction, with ``SELECT
    ... FOR UPDATE SKIP LOCKED`` where the database has it, so a concurrent run
    chooses other rows; the conditional takeover is what guarantees a row is
    acted on once. Keep batches small enough to finish within ``LEASE_SECONDS``:
    a lease that expires while its row waits in the batch is taken over by the
    next run, and this run's completion is then refused (safe, but wasted).
    """
    report = ReconcileReport()
    now = now or timezone.now()
    rows = leases.expired(now=now)[: limit or conf.RECONCILE_BATCH_SIZE]
    work: list[tuple[ProcessedMessage, Lease]] = []
    with transaction.atomic():
        if connection.features.has_select_for_update_skip_locked:
            rows = rows.select_for_update(skip_locked=True)
        for row in rows:
            if row.attempts > conf.RECONCILE_MAX_STALLS:
                result = _give_up(row)
            else:
                lease = leases.takeover(row)
                if lease is not None:
                    work.append((row, lease))
                    continue
                result = StepResult.SKIPPED
            report.actions[result.value] += 1
            transaction.on_commit(lambda row=row, v=result.value: _announce(row, v))  # type: ignore[misc]
    for row, lease in work:
        result = _act(row, lease, "reconciler")
        _announce(row, result.value)
        report.actions[result.value] += 1
    if report.actions:
        logger.info("reconciled: %s", report)
    return report


def retry(pk: int, *, via: str = "admin") -> StepResult:
    """Operator retry of a stuck or failed row: reopen it and run its step (verifying first)."""
    now = timezone.now()
    ProcessedMessage.objects.filter(pk=pk, status=InboxStatus.FAILED).update(
        status=InboxStatus.PROCESSING, lease_expires_at=now, updated_at=now
    )
    row = ProcessedMessage.objects.filter(pk=pk, status=InboxStatus.PROCESSING).first()
    if row is None:
        return StepResult.SKIPPED
    if row.lease_expires_at is not None and row.lease_expires_at > now:
        return StepResult.SKIPPED  # a worker is on it right now
    return reconcile_row(row, via=via, force=True)


def complete_if_verified(pk: int, *, via: str = "admin") -> StepResult:
    """Operator "complete": take the row over, and finish it only if the verifier confirms."""
    row = ProcessedMessage.objects.filter(pk=pk).first()
    if row is None or row.status not in (InboxStatus.PROCESSING, InboxStatus.FAILED):
        return StepResult.SKIPPED
    step = load_step(row)
    if step is None:
        return StepResult.SKIPPED
    if row.status == InboxStatus.FAILED:
        now = timezone.now()
        ProcessedMessage.objects.filter(pk=pk, status=InboxStatus.FAILED).update(
            status=InboxStatus.PROCESSING, lease_expires_at=now, updated_at=now
        )
        row.refresh_from_db()
        if row.status != InboxStatus.PROCESSING:
            return StepResult.SKIPPED
    elif row.lease_expires_at is not None and row.lease_expires_at > timezone.now():
        return StepResult.SKIPPED
    lease = leases.takeover(row, force=True)
    if lease is None:
        return StepResult.SKIPPED
    if step.verify(lease) is not leases.Verification.DONE:
        leases.release(lease, error="an operator asked to complete it; the effect is not verified")
        return StepResult.RETRY
    return step.finish(lease)
