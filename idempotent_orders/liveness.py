"""Who is alive: Celery workers and the reconciler leave a heartbeat; the dashboard reads it.

A worker process writes ``worker:<hostname>`` every :data:`EVERY` seconds (a
thread started by Celery's ``worker_ready`` signal); each reconciler pass writes
``reconciler``. The beats are rows of :class:`~idempotent_orders.models.Heartbeat`
in the database, so the admin's process reads what every worker wrote, whatever
the caches are (a process-local cache included); beats older than :data:`FORGET`
seconds are deleted. Advisory only: a missing beat says "look", never "the work
was lost" (the inbox and leases keep that).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections

logger = logging.getLogger("idempotent_orders")

#: Seconds between a worker's beats.
EVERY = 15
#: A worker not heard from for this long is shown as gone.
SILENT_AFTER = 60
#: Beats older than this are forgotten (a worker stopped for good).
FORGET = 3600


def reconciler_silent_after() -> float:
    """Seconds without a reconciler pass after which it is shown as not running: two of
    its intervals on ``CELERY_BEAT_SCHEDULE`` (one pass missed), at least
    :data:`SILENT_AFTER`; five minutes when the schedule is not in the settings."""
    from django.conf import settings

    for entry in (getattr(settings, "CELERY_BEAT_SCHEDULE", None) or {}).values():
        if entry.get("task") != "idempotent_orders.reconcile":
            continue
        every = entry.get("schedule")
        seconds = every.total_seconds() if isinstance(every, timedelta) else every
        if isinstance(seconds, int | float):
            return max(float(SILENT_AFTER), 2 * float(seconds))
    return 300.0


def beat(name: str, *, at: float | None = None) -> None:
    """Record that ``name`` (``worker:<hostname>``, ``reconciler``) is alive now."""
    from idempotent_orders.models import Heartbeat

    when = datetime.fromtimestamp(time.time() if at is None else at, tz=UTC)
    try:
        if not Heartbeat.objects.filter(name=name).update(beat_at=when):
            Heartbeat.objects.get_or_create(name=name, defaults={"beat_at": when})
        Heartbeat.objects.filter(beat_at__lt=when - timedelta(seconds=FORGET)).delete()
    except Exception:  # advisory: a database outage must not stop a worker
        logger.debug("liveness: could not record %s", name, exc_info=True)


def ages(prefix: str = "") -> dict[str, float]:
    """Seconds since each name (starting with ``prefix``) was last heard from."""
    from idempotent_orders.models import Heartbeat

    now = time.time()
    try:
        rows = list(
            Heartbeat.objects.filter(name__startswith=prefix).values_list("name", "beat_at")
        )
    except Exception:
        logger.debug("liveness: could not read the beats", exc_info=True)
        return {}
    return {
        name: max(0.0, now - beat_at.timestamp())
        for name, beat_at in rows
        if now - beat_at.timestamp() < FORGET
    }


def start_worker_heartbeat(hostname: str) -> threading.Thread:
    """Beat for this worker every :data:`EVERY` seconds, in a daemon thread."""

    def run() -> None:
        while True:
            beat(f"worker:{hostname}")
            # This thread's own connection: closed between beats, not held for 15 s.
            connections.close_all()
            time.sleep(EVERY)

    thread = threading.Thread(target=run, name="idempotent-orders-heartbeat", daemon=True)
    thread.start()
    return thread


def _on_worker_ready(sender: Any = None, **kwargs: Any) -> None:
    hostname = getattr(sender, "hostname", None) or "worker"
    start_worker_heartbeat(str(hostname))
