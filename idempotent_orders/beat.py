"""The periodic tasks a project runs on Celery beat, in one place so none is forgotten.

``CELERY_BEAT_SCHEDULE = beat_schedule()`` schedules all of them at the recommended
intervals. Each one is a backstop for something that went wrong elsewhere (a worker
killed mid-call, an on-commit publish that did not get through, a predecessor lost to a
failover), so a missing entry fails silently: nothing says "look" (docs/operations.md).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PERIODIC_TASKS", "beat_schedule"]

#: name -> (Celery task, seconds between runs), the recommended schedule.
PERIODIC_TASKS: dict[str, tuple[str, float]] = {
    # Leases that expired (a worker died mid-call): verify, then complete or call again.
    "reconcile": ("idempotent_orders.reconcile", 30.0),
    # Parked messages whose predecessor never came (a failover, a producer that died):
    # released if they can go ahead, marked overdue past PARKED_TIMEOUT.
    "surface-parked": ("idempotent_orders.surface_overdue_parked", 60.0),
    # Outbox rows whose on-commit publish did not get through.
    "relay-outbox": ("idempotent_orders.relay_outbox", 5.0),
    # Durable timers that are due (unpaid orders expire).
    "timers": ("idempotent_orders.fire_due_timers", 10.0),
    # Inbox rows, parked leftovers and keys past their retention windows.
    "purge": ("idempotent_orders.purge", 3600.0),
    # Sent outbox rows past OUTBOX_RETENTION.
    "purge-outbox": ("idempotent_orders.purge_outbox", 86400.0),
}


def beat_schedule(*, prefix: str = "idempotent-orders-", **every: float | None) -> dict[str, Any]:
    """``CELERY_BEAT_SCHEDULE`` entries for every periodic task of the app.

    ``every`` changes an interval by name (``reconcile=10.0``) or leaves a task out
    (``timers=None``); names are those of :data:`PERIODIC_TASKS`, with ``_`` for ``-``.
    Merge the result with the project's own entries::

        CELERY_BEAT_SCHEDULE = {**beat_schedule(), "my-task": {...}}
    """
    changes = {name.replace("_", "-"): seconds for name, seconds in every.items()}
    unknown = sorted(set(changes) - set(PERIODIC_TASKS))
    if unknown:
        raise ValueError(
            f"unknown periodic task {', '.join(unknown)}; expected one of "
            f"{', '.join(name.replace('-', '_') for name in PERIODIC_TASKS)}"
        )
    schedule: dict[str, Any] = {}
    for name, (task, seconds) in PERIODIC_TASKS.items():
        interval = changes.get(name, seconds)
        if interval is None:
            continue
        if interval <= 0:
            raise ValueError(f"{name}: the interval must be positive seconds, not {interval!r}")
        schedule[f"{prefix}{name}"] = {"task": task, "schedule": float(interval)}
    return schedule
