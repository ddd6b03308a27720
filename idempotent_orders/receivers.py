"""Signal receivers connected in ``AppConfig.ready``."""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import task_postrun, task_prerun, worker_process_init, worker_process_shutdown
from django.db import close_old_connections
from django.dispatch import receiver

from idempotent_orders import stats
from idempotent_orders.consuming.decision import COUNTERS
from idempotent_orders.signals import dedup_answered, message_consumed

logger = logging.getLogger("idempotent_orders")


# -- counters and the per-process fast path (dedup layers, stats) --------------


@receiver(message_consumed, dispatch_uid="idempotent_orders.count_outcome")
def count_outcome(sender: Any, outcome: str, **kwargs: Any) -> None:
    stats.incr(f"outcome:{outcome}")


def _count_outcomes(consumer: str, outcome: Any, n: int) -> None:
    stats.incr(f"outcome:{outcome}", n)


COUNTERS["idempotent_orders.count_outcome"] = _count_outcomes  # a batch counts at once


@receiver(dedup_answered, dispatch_uid="idempotent_orders.count_layer")
def count_layer(sender: Any, layer: str, **kwargs: Any) -> None:
    stats.incr(f"layer:{layer}")


@worker_process_init.connect(dispatch_uid="idempotent_orders.dedup_worker_init")
def reset_fast_path(**kwargs: Any) -> None:
    """A new worker process starts with empty filters; its first lookup loads the inbox.

    Loading here directly would use the database connection inherited from the
    parent before Celery's Django fix-up replaces it, so the rebuild is lazy.
    """
    from idempotent_orders import dedup

    dedup.reset()
    stats.reset()


@worker_process_shutdown.connect(dispatch_uid="idempotent_orders.stats_worker_shutdown")
def flush_counters(**kwargs: Any) -> None:
    stats.flush()


@task_prerun.connect(dispatch_uid="idempotent_orders.db_connections_prerun")
@task_postrun.connect(dispatch_uid="idempotent_orders.db_connections_postrun")
def recycle_db_connections(**kwargs: Any) -> None:
    """Treat each task like a request: drop broken or over-age database connections.

    Celery's Django fixup closes every connection around every task unless
    ``CELERY_DB_REUSE_MAX`` is set; with it set (recommended: a reconnect per
    message costs more than the message), this keeps ``CONN_MAX_AGE`` and
    ``CONN_HEALTH_CHECKS`` meaningful and replaces a connection a failover or
    ``pg_terminate_backend`` broke before the task's retry runs.

    An eager task (``apply()``, ``task_always_eager``) runs inside its caller,
    maybe in the caller's transaction: its connection is not the task's to drop.
    """
    task = kwargs.get("task")
    if task is not None and getattr(task.request, "is_eager", False):
        return
    close_old_connections()


# -- trace context of the message, current while its task runs -----------------------------


@task_prerun.connect(dispatch_uid="idempotent_orders.trace_prerun")
def restore_trace(task_id: str = "", task: Any = None, **kwargs: Any) -> None:
    """Make the message's ``traceparent`` / ``correlation_id`` current for the task."""
    from idempotent_orders import tracing

    if task is None or getattr(task.request, "is_eager", False):
        return  # an eager task runs in its caller's context already
    context = tracing.restore_for_task(task_id, task.request)
    if context:
        logger.debug(
            "task %s runs in trace %s",
            task_id,
            context.traceparent or "-",
            extra={"message_id": task_id, **context.headers()},
        )


@task_postrun.connect(dispatch_uid="idempotent_orders.trace_postrun")
def forget_trace(task_id: str = "", task: Any = None, **kwargs: Any) -> None:
    from idempotent_orders import tracing

    tracing.forget_for_task(task_id)
