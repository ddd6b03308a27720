"""Who is alive: Celery workers and the reconciler leave a heartbeat; the dashboard reads it.

A worker process writes ``worker:<hostname>`` every :data:`EVERY` seconds (a
thread started by Celery's ``worker_ready`` signal); each reconciler pass writes
``reconciler``. The beats live in one entry of the ``LOCK_CACHE`` (Redis in
production), forgotten after :data:`FORGET` seconds. Advisory only: a missing
beat says "look", never "the work was lost" (the inbox and leases keep that).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from django.core.cache import caches

from idempotent_orders.conf import conf

logger = logging.getLogger("idempotent_orders")

KEY = "idempotent_orders:alive"
#: Seconds between a worker's beats.
EVERY = 15
#: A worker not heard from for this long is shown as gone.
SILENT_AFTER = 60
#: Beats older than this are forgotten (a worker stopped for good).
FORGET = 3600

_lock = threading.Lock()


def beat(name: str, *, at: float | None = None) -> None:
    """Record that ``name`` (``worker:<hostname>``, ``reconciler``) is alive now."""
    now = time.time() if at is None else at
    try:
        cache = caches[conf.LOCK_CACHE]
        with _lock:
            seen: dict[str, float] = cache.get(KEY) or {}
            seen[name] = now
            seen = {k: v for k, v in seen.items() if now - v < FORGET}
            cache.set(KEY, seen, timeout=FORGET)
    except Exception:  # advisory: a cache outage must not stop a worker
        logger.debug("liveness: could not record %s", name, exc_info=True)


def ages(prefix: str = "") -> dict[str, float]:
    """Seconds since each name (starting with ``prefix``) was last heard from."""
    try:
        seen: dict[str, float] = caches[conf.LOCK_CACHE].get(KEY) or {}
    except Exception:
        logger.debug("liveness: could not read the beats", exc_info=True)
        return {}
    now = time.time()
    return {k: max(0.0, now - v) for k, v in seen.items() if k.startswith(prefix)}


def shared() -> bool:
    """Whether the ``LOCK_CACHE`` is shared between processes (not local memory or dummy)."""
    from django.core.cache.backends.dummy import DummyCache
    from django.core.cache.backends.locmem import LocMemCache

    try:
        return not isinstance(caches[conf.LOCK_CACHE], LocMemCache | DummyCache)
    except Exception:
        return False


def start_worker_heartbeat(hostname: str) -> threading.Thread:
    """Beat for this worker every :data:`EVERY` seconds, in a daemon thread."""

    def run() -> None:
        while True:
            beat(f"worker:{hostname}")
            time.sleep(EVERY)

    thread = threading.Thread(target=run, name="idempotent-orders-heartbeat", daemon=True)
    thread.start()
    return thread


def _on_worker_ready(sender: Any = None, **kwargs: Any) -> None:
    hostname = getattr(sender, "hostname", None) or "worker"
    start_worker_heartbeat(str(hostname))
