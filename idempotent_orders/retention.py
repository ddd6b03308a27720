"""Retention: delete inbox rows, parked leftovers, idempotency keys, webhook events and
fired timers past their windows.

Run by the ``idempotent_orders.purge`` task (on beat) and ``manage.py purge_idempotent_orders``.
Deletes in batches of ``PURGE_BATCH_SIZE`` so no statement holds locks for long.
On an inbox partitioned by time (:mod:`~idempotent_orders.partitioning`),
whole partitions past the window are dropped instead, their kept rows moved first.
Never touches ``processing`` inbox rows (leased work in flight) or ``failed``
ones (waiting for an operator), nor keys still ``in_flight``, nor webhook events
not consumed yet (``received``, ``failed``), nor timers not fired.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Model, Q
from django.utils import timezone

from idempotent_orders.conf import conf
from idempotent_orders.models import (
    IdempotencyKey,
    InboxStatus,
    KeyQuota,
    KeyState,
    LeaseAttempt,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
    Timer,
    TimerStatus,
    WebhookEvent,
    WebhookStatus,
)
from idempotent_orders.partitioning import (
    Maintenance,
    is_partitioned,
    maintain,
    partitioned_inbox,
    partitions,
)

__all__ = [
    "PurgeReport",
    "maintain_partitions",
    "purge",
    "purgeable",
    "purgeable_timers",
    "purgeable_webhook_events",
]

logger = logging.getLogger("idempotent_orders")


@dataclass
class PurgeReport:
    inbox: int = 0
    parked: int = 0
    keys: int = 0
    webhooks: int = 0
    timers: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "inbox": self.inbox,
            "parked": self.parked,
            "keys": self.keys,
            "webhooks": self.webhooks,
            "timers": self.timers,
        }


def purgeable(cutoff: datetime) -> Q:
    """Inbox rows whose dedup window has passed; every other row is kept."""
    return (
        # Rows changed lately (given up, resolved by an operator) wait a full window too.
        Q(created_at__lt=cutoff, updated_at__lt=cutoff)
        & Q(status__in=[InboxStatus.DONE, InboxStatus.REJECTED])
        # A message still parked keeps its inbox row until it is released.
        & ~Q(outcome=Outcome.PARKED)
    )


def purgeable_webhook_events(now: datetime) -> Q:
    """Webhook events past their window: consumed ones (and signed events flagged as
    reusing another event's id) after ``WEBHOOK_RETENTION``, other refused requests after
    ``WEBHOOK_REFUSED_RETENTION``, both counted from their last delivery. Events not
    consumed yet (``received``, ``failed``) are kept."""
    from idempotent_orders.webhooks.ingress import REUSED

    kept = now - timedelta(seconds=conf.WEBHOOK_RETENTION)
    refused = now - timedelta(seconds=conf.WEBHOOK_REFUSED_RETENTION)
    flagged = Q(error__startswith=f"{REUSED}:")
    return (
        Q(status=WebhookStatus.PROCESSED, received_at__lt=kept, last_delivery_at__lt=kept)
        | (
            Q(status=WebhookStatus.REJECTED, received_at__lt=kept, last_delivery_at__lt=kept)
            & flagged
        )
        | (
            Q(status=WebhookStatus.REJECTED, received_at__lt=refused)
            & Q(last_delivery_at__lt=refused)
            & ~flagged
        )
    )


def purgeable_timers(now: datetime) -> Q:
    """Timers fired more than ``TIMER_RETENTION`` ago; pending and failed ones are kept."""
    cutoff = now - timedelta(seconds=conf.TIMER_RETENTION)
    # A timer fires once due: due_at <= fired_at, so due_at lets the (status, due_at) index work.
    return Q(status=TimerStatus.FIRED, due_at__lt=cutoff, fired_at__lt=cutoff)


def _delete_in_batches(model: type[Model], condition: Q, batch_size: int) -> int:
    total = 0
    while True:
        pks = list(
            model._default_manager.filter(condition)
            .order_by("pk")
            .values_list("pk", flat=True)[:batch_size]
        )
        if not pks:
            return total
        # The condition is repeated: a row that changed since it was read stays.
        deleted, _ = model._default_manager.filter(condition, pk__in=pks).delete()
        total += deleted


def maintain_partitions(*, now: datetime | None = None, using: str = "default") -> Maintenance:
    """Partitions ready ahead of ``now``; those past ``DEDUP_RETENTION`` dropped, their
    rows that :func:`purgeable` would keep moved to the kept partition first."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=conf.DEDUP_RETENTION)
    return maintain(now=now, cutoff=cutoff, kept=~purgeable(cutoff), using=using)


def _give_up_parked(cutoff: datetime, batch_size: int) -> int:
    """Parked messages that waited too long: keep them, explained, as rejected inbox rows."""
    total = 0
    while True:
        batch = list(ParkedMessage.objects.filter(parked_at__lt=cutoff).order_by("pk")[:batch_size])
        if not batch:
            return total
        for parked in batch:
            with transaction.atomic():
                # Claim by deleting, as release_parked() does: only one of them wins.
                if not ParkedMessage.objects.filter(pk=parked.pk).delete()[0]:
                    continue
                ProcessedMessage.objects.filter(
                    consumer=parked.consumer,
                    message_id=parked.message_id,
                    outcome=Outcome.PARKED,
                ).update(
                    # Touched now: the explained row is kept a full DEDUP_RETENTION.
                    updated_at=timezone.now(),
                    status=InboxStatus.REJECTED,
                    outcome=Outcome.REJECTED,
                    error=f"gave up waiting since {parked.parked_at:%Y-%m-%d %H:%M}: "
                    f"{parked.reason}",
                )
                total += 1
                logger.warning(
                    "gave up parked message %s: %s",
                    parked.message_id,
                    parked.reason,
                    extra={"message_id": parked.message_id, "order_id": parked.order_id},
                )


def purge(*, now: datetime | None = None, batch_size: int | None = None) -> PurgeReport:
    """Delete what is older than its window; returns how many rows of each kind went."""
    now = now or timezone.now()
    size = batch_size or conf.PURGE_BATCH_SIZE
    report = PurgeReport()
    report.parked = _give_up_parked(now - timedelta(seconds=conf.PARKED_RETENTION), size)
    inbox_cutoff = now - timedelta(seconds=conf.DEDUP_RETENTION)
    condition = purgeable(inbox_cutoff)
    if partitioned_inbox() and is_partitioned():
        report.inbox = maintain_partitions(now=now).dropped_rows
        ranges = [p for p in partitions() if p.start is not None and p.end is not None]
        if ranges:
            # Only the default partition's rows: a period partition goes whole, when its
            # last row is past the window (a partition whose drop was postponed too),
            # so its rows outlive DEDUP_RETENTION by up to one period, never less.
            condition &= Q(created_at__lt=min(p.start for p in ranges if p.start)) | Q(
                created_at__gte=max(p.end for p in ranges if p.end)
            )
    # On a partitioned inbox this finds only the kept rows that have since finished.
    report.inbox += _delete_in_batches(ProcessedMessage, condition, size)
    # The leased steps' attempts: kept as long as the inbox rows they belong to.
    _delete_in_batches(LeaseAttempt, Q(at__lt=inbox_cutoff), size)
    # Expired keys and tokens; a claim whose lease is still live stays (as in
    # http.keys.purge_expired, which deletes without batching).
    report.keys = _delete_in_batches(
        IdempotencyKey,
        Q(expires_at__lt=now) & ~Q(state=KeyState.IN_FLIGHT, lease_expires_at__gt=now),
        size,
    )
    # Quota bounds no claim raised for KEY_TTL: their keys have expired (a principal
    # without a bound is counted at its next claim).
    _delete_in_batches(KeyQuota, Q(updated_at__lt=now - timedelta(seconds=conf.KEY_TTL)), size)
    report.webhooks = _delete_in_batches(WebhookEvent, purgeable_webhook_events(now), size)
    report.timers = _delete_in_batches(Timer, purgeable_timers(now), size)
    if any(report.as_dict().values()):
        logger.info("purged %s", report.as_dict())
    return report
