"""Failed ``@idempotent`` runs: counted on their inbox row, dead after too many, requeued.

A run that raises is counted on its inbox row (the run's own writes rolled
back); at ``IDEMPOTENT_MAX_ATTEMPTS`` (or on a permanent failure) the row is
*dead*: logged, announced by ``message_dead``, and refused to later deliveries
until an operator requeues it (:func:`requeue_inbox`, the admin, the
``requeue_idempotent`` command). :func:`inbox_stats` counts them for dashboards.
The decorator itself is in :mod:`idempotent_orders.idempotent`, which re-exports
:func:`requeue_inbox` and :func:`inbox_stats`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from typing import Any

from django.db import IntegrityError, OperationalError, router, transaction
from django.db.models import Count, Q
from django.utils import timezone

from idempotent_orders.models import InboxStatus, ProcessedMessage
from idempotent_orders.signals import message_dead

__all__ = ["inbox_stats", "record_failure", "requeue_inbox"]

logger = logging.getLogger("idempotent_orders")


def record_failure(
    name: str,
    message_id: str,
    exc: Exception,
    *,
    permanent: bool,
    limit: int,
    using: str | None,
) -> bool:
    """Count a failed run on the inbox row (the run's own write rolled back); True if dead.

    Never raises: when the failure cannot be recorded (the database is down) it
    is logged and the run's exception goes on as before.
    """
    error = f"{type(exc).__name__}: {exc}"[:2000]
    # Concurrent recorders of one key can deadlock (MySQL's gap locks); try again,
    # unless a caller's transaction is open (the deadlock rolled it back).
    tries = 1 if transaction.get_connection(using).in_atomic_block else 5
    try:
        for attempt in range(1, tries + 1):
            try:
                return _count_failure(
                    name, message_id, error, permanent=permanent, limit=limit, using=using
                )
            except OperationalError:
                if attempt == tries:
                    raise
                time.sleep(0.01 * attempt)
        return False  # pragma: no cover - the loop returns or raises
    except Exception:
        logger.exception(
            "%s: could not record the failure of %s",
            name,
            message_id,
            extra={"message_id": message_id},
        )
        return False


def _count_failure(
    name: str, message_id: str, error: str, *, permanent: bool, limit: int, using: str | None
) -> bool:
    rows = ProcessedMessage.objects.using(using)
    now = timezone.now()
    with transaction.atomic(using=using):
        row = (
            rows.select_for_update()
            .filter(consumer=name, message_id=message_id)
            .values_list("pk", "status", "attempts")
            .first()
        )
        if row is not None and row[1] != InboxStatus.PROCESSING:
            # Finished (or dead) by another delivery meanwhile.
            return bool(row[1] == InboxStatus.DEAD)
        attempts = 1 if row is None else row[2] + 1
        dead = permanent or attempts >= limit
        values: dict[str, Any] = {
            "status": InboxStatus.DEAD if dead else InboxStatus.PROCESSING,
            "attempts": attempts,
            "error": error,
            "dead_at": now if dead else None,
            "lease_expires_at": None,
        }
        if row is None:
            try:
                with transaction.atomic(using=using):
                    rows.create(consumer=name, message_id=message_id, **values)
            except IntegrityError:  # another delivery's failure got there first
                return _count_failure(
                    name, message_id, error, permanent=permanent, limit=limit, using=using
                )
        else:
            rows.filter(pk=row[0]).update(**values, updated_at=now)
        if dead:
            transaction.on_commit(
                functools.partial(_died, name, message_id, attempts, error, permanent),
                using=using,
            )
        else:
            logger.warning(
                "%s: run %d of %s failed (of %d before it is dead): %s",
                name,
                attempts,
                message_id,
                limit,
                error,
                extra={"message_id": message_id},
            )
    return dead


def _died(name: str, message_id: str, attempts: int, error: str, permanent: bool) -> None:
    logger.error(
        "%s: %s is dead after %d run(s)%s: %s",
        name,
        message_id,
        attempts,
        " (permanent failure)" if permanent else "",
        error,
        extra={"message_id": message_id},
    )
    message_dead.send(
        sender=ProcessedMessage,
        consumer=name,
        message_id=message_id,
        attempts=attempts,
        error=error,
    )


def requeue_inbox(
    *,
    consumer: str | None = None,
    message_ids: Iterable[str] | None = None,
    ids: Iterable[int] | None = None,
    dry_run: bool = False,
    using: str | None = None,
) -> int:
    """Put dead ``@idempotent`` rows back to ``processing`` with no attempts; returns how many.

    The next delivery of the message runs the work again (the row holds no
    arguments to run it with: deliver the message again, e.g. requeue its
    dead outbox row or ``apply_async(..., task_id=message_id)``). Without a
    filter every dead row is requeued; ``consumer``, ``message_ids`` and ``ids``
    narrow it down (together: rows matching all). Only dead rows change, and
    ``error`` is kept as the record of why it died. ``dry_run`` counts and
    changes nothing.
    """
    db = using or router.db_for_write(ProcessedMessage)
    rows = ProcessedMessage.objects.using(db).filter(status=InboxStatus.DEAD)
    if consumer is not None:
        rows = rows.filter(consumer=consumer)
    if message_ids is not None:
        rows = rows.filter(message_id__in=list(message_ids))
    if ids is not None:
        rows = rows.filter(pk__in=list(ids))
    if dry_run:
        return rows.count()
    return rows.update(
        status=InboxStatus.PROCESSING,
        attempts=0,
        dead_at=None,
        lease_expires_at=None,
        updated_at=timezone.now(),
    )


def inbox_stats(*, using: str | None = None) -> dict[str, int]:
    """Counters for dashboards: dead ``@idempotent`` rows, and rows whose last run failed
    and that wait for their next delivery (``failing``: ``processing`` without a lease).
    """
    db = using or router.db_for_write(ProcessedMessage)
    counts = dict(
        ProcessedMessage.objects.using(db)
        .filter(
            Q(status=InboxStatus.DEAD)
            | Q(status=InboxStatus.PROCESSING, lease_expires_at__isnull=True)
        )
        .values_list("status")
        .annotate(n=Count("id"))
        .order_by()
    )
    return {
        "dead": counts.get(InboxStatus.DEAD, 0),
        "failing": counts.get(InboxStatus.PROCESSING, 0),
    }
