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

from idempotent_orders import fulfilment, leases
from idempotent_orders.conf import conf
from idempotent_orders.leases import Lease, StepResult
from idempotent_orders.models import InboxStatus, ProcessedMessage
from idempotent_orders.signals import message_reconciled

__all__ = ["ReconcileReport", "complete_if_verified", "reconcile", "reconcile_row", "retry"]

logger = logging.getLogger("idempotent_orders")

# Imported for its side effect: it registers the fulfilment step.
_FULFILMENT = fulfilment.STEP


@dataclass
class ReconcileReport:
    """What one run did, by action (completed, retry, failed, skipped)."""

    actions: Counter[str] = field(default_factory=Counter)

    def __str__(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(self.actions.items())) or "nothing to do"


def _candidates(limit: int, now: datetime) -> list[int]:
    query = leases.expired(now=now).values_list("pk", flat=True)[:limit]
    if connection.features.has_select_for_update_skip_locked:
        # Lock the candidates only while choosing them: a concurrent run skips
        # these and picks others. The takeover below stays the authority.
        with transaction.atomic():
            return list(query.select_for_update(skip_locked=True))
    return list(query)


def _announce(row: ProcessedMessage, action: str) -> None:
    message_reconciled.send(
        sender=ProcessedMessage,
        consumer=row.consumer,
        message_id=row.message_id,
        order_id=row.order_id,
        action=action,
    )


def reconcile_row(
    row: ProcessedMessage, *, via: str = "reconciler", force: bool = False
) -> StepResult:
    """Handle one ``processing`` row whose lease expired (``force``: even a live one).

    After ``RECONCILE_MAX_STALLS`` expired claims the row is marked ``failed``;
    otherwise the lease is taken over and the consumer's step verifies, then
    completes or performs again. Rows of a consumer without a registered step
    are failed after the same number of stalls, since nothing can verify them.
    """
    step = leases.get_step(row.consumer)
    stalls = row.attempts  # this takeover would be stall number `attempts`
    if not force and stalls > conf.RECONCILE_MAX_STALLS:
        reason = f"stalled {row.attempts} times; last error: {row.error or 'none'}"
        done = leases.fail(row.pk, reason=reason, attempt=row.attempts)
        action = StepResult.FAILED if done else StepResult.SKIPPED
        if done:
            logger.error(
                "gave up on %s (%s): %s",
                row.message_id,
                row.consumer,
                reason,
                extra={"message_id": row.message_id, "order_id": row.order_id},
            )
        _announce(row, action.value)
        return action
    lease: Lease | None = leases.takeover(row, force=force)
    if lease is None:
        _announce(row, StepResult.SKIPPED.value)
        return StepResult.SKIPPED
    if step is None:
        leases.release(lease, error=f"no leased step is registered for {row.consumer!r}")
        _announce(row, StepResult.RETRY.value)
        return StepResult.RETRY
    result = leases.run_step(step, lease, via=via)
    _announce(row, result.value)
    return result


def reconcile(*, limit: int | None = None, now: datetime | None = None) -> ReconcileReport:
    """One pass over expired leases, at most ``limit`` rows (``RECONCILE_BATCH_SIZE``)."""
    report = ReconcileReport()
    now = now or timezone.now()
    for pk in _candidates(limit or conf.RECONCILE_BATCH_SIZE, now):
        row = ProcessedMessage.objects.filter(pk=pk, status=InboxStatus.PROCESSING).first()
        if row is None or row.lease_expires_at is None or row.lease_expires_at >= now:
            report.actions[StepResult.SKIPPED.value] += 1
            continue
        report.actions[reconcile_row(row).value] += 1
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
    step = leases.get_step(row.consumer)
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
    if step.verify(lease) is not leases.Verdict.DONE:
        leases.release(lease, error="an operator asked to complete it; the effect is not verified")
        return StepResult.RETRY
    return step.finish(lease)
