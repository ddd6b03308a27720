"""The operator's tools: dead rows requeued, sent rows purged, the outbox counted.

What ``manage.py requeue_outbox``, ``purge_outbox`` and ``idempotent_orders_stats``,
the admin and the metrics call; none of it runs in the publish path.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from django.db import router
from django.db.models import Min
from django.db.models.functions import Now
from django.utils import timezone

from idempotent_orders.conf import conf
from idempotent_orders.models import OutboxMessage, OutboxStatus
from idempotent_orders.outbox import failures


def requeue_outbox(
    *,
    ids: Iterable[int] | None = None,
    message_ids: Iterable[str] | None = None,
    task_name: str | None = None,
    dry_run: bool = False,
    using: str | None = None,
) -> int:
    """Put dead rows back to pending, due now, with their attempts reset; returns how many.

    Without a filter every dead row is requeued; ``ids``, ``message_ids`` and
    ``task_name`` narrow it down (together: rows matching all of them). Only
    dead rows change (a row that is pending or sent is left alone), and
    ``last_error`` is kept as the record of why it died. ``dry_run`` counts
    the rows and changes nothing.
    """
    db = using or router.db_for_write(OutboxMessage)
    rows = OutboxMessage.objects.using(db).filter(status=OutboxStatus.DEAD)
    if ids is not None:
        rows = rows.filter(pk__in=list(ids))
    if message_ids is not None:
        rows = rows.filter(message_id__in=list(message_ids))
    if task_name is not None:
        rows = rows.filter(task_name=task_name)
    if dry_run:
        return rows.count()
    return rows.update(
        status=OutboxStatus.PENDING,
        attempts=0,
        available_at=Now(),
        claimed_until=None,
        dead_at=None,
    )


def purge_outbox(*, older_than: int | None = None, using: str | None = None) -> int:
    """Delete sent rows older than ``older_than`` seconds (default ``OUTBOX_RETENTION``)."""
    age = conf.OUTBOX_RETENTION if older_than is None else older_than
    cutoff = timezone.now() - timedelta(seconds=age)
    db = using or router.db_for_write(OutboxMessage)
    deleted, _ = (
        OutboxMessage.objects.using(db)
        .filter(status=OutboxStatus.SENT, sent_at__lt=cutoff)
        .delete()
    )
    return deleted


def outbox_stats(*, using: str | None = None, sent: bool = True) -> dict[str, Any]:
    """Counters for dashboards: pending, sent, dead, retried (rows whose publish failed at
    least once) and the age in seconds of the oldest pending row.

    Pending, dead and retried rows are counted on their partial indexes (PostgreSQL and
    SQLite); ``sent=False`` leaves out the count of sent rows (``None``), the one count
    that reads the whole table: the admin's dashboard asks for it so.
    """
    db = using or router.db_for_write(OutboxMessage)
    rows = OutboxMessage.objects.using(db)
    oldest = rows.filter(status=OutboxStatus.PENDING).aggregate(t=Min("created_at"))["t"]
    return {
        "pending": rows.filter(status=OutboxStatus.PENDING).count(),
        "sent": rows.filter(status=OutboxStatus.SENT).count() if sent else None,
        "dead": rows.filter(status=OutboxStatus.DEAD).count(),
        "retried": rows.filter(attempts__gt=0).count(),
        # This process's relay paused on a broker outage (see Breaker).
        "broker_paused": failures.breaker.paused(),
        "oldest_pending_age": (timezone.now() - oldest).total_seconds() if oldest else None,
    }
