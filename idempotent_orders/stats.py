"""Counters of consume outcomes and dedup layers: per process, summed in a Redis hash.

Why there: counting is on the hot path, so each process increments a local
``Counter`` (no I/O) and adds it to one Redis hash (``HINCRBY`` in a pipeline)
at most every ``STATS_FLUSH_INTERVAL`` seconds and when a worker process exits.
The hash is shared by every process and host and survives restarts; a crash
loses at most one interval of counts, which is fine for counters that are
observability, never the authority. Without django-redis the counts stay local.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from django.core.cache import caches

from idempotent_orders.conf import conf

__all__ = ["flush", "incr", "local", "read", "reset", "write_on_cluster_with"]

logger = logging.getLogger("idempotent_orders")

_HASH = "stats"
_lock = threading.Lock()
_pending: Counter[str] = Counter()
_local: Counter[str] = Counter()
_last_flush = 0.0

#: Adds a batch of counts to the hash on a Redis Cluster, bounded as a fast-path call (a
#: master that failed is skipped until its back-off ends); False when the cache is not a
#: cluster. Given by the dedup layer when the app is ready, which counts through this
#: module: this module imports no dedup code.
ClusterWriter = Callable[[Any, str, dict[str, int]], bool]
_cluster_writer: ClusterWriter | None = None


def write_on_cluster_with(writer: ClusterWriter | None) -> None:
    """Flush the counts on a Redis Cluster through ``writer`` (None: a plain pipeline)."""
    global _cluster_writer
    _cluster_writer = writer


def _client_and_key() -> tuple[Any, str] | None:
    alias = conf.DEDUP_CACHE_ALIAS
    if not alias:
        return None
    try:
        from django_redis import get_redis_connection

        cache = caches[alias]
        return get_redis_connection(alias), cache.make_key(_HASH)
    except (ImportError, NotImplementedError, AttributeError):
        return None  # not a django-redis cache


def incr(name: str, amount: int = 1) -> None:
    """Count one event (an outcome value or a dedup layer value)."""
    with _lock:
        _pending[name] += amount
        _local[name] += amount
    if time.monotonic() - _last_flush >= conf.STATS_FLUSH_INTERVAL:
        flush()


def flush() -> bool:
    """Add this process's pending counts to the shared hash; False if Redis failed."""
    global _last_flush
    with _lock:
        _last_flush = time.monotonic()
        batch = dict(_pending)
        _pending.clear()
    if not batch:
        return True
    target = _client_and_key()
    if target is None:
        return True
    client, key = target
    try:
        # On a Redis Cluster the flush is bounded as a fast-path call is (it runs on the
        # consumers' hot path): through the writer the dedup layer gave.
        writer = _cluster_writer
        if writer is None or not writer(caches[conf.DEDUP_CACHE_ALIAS], key, batch):
            pipe = client.pipeline(transaction=False)
            for name, amount in batch.items():
                pipe.hincrby(key, name, amount)
            pipe.execute()
    except Exception as exc:
        with _lock:  # keep them for the next flush
            _pending.update(batch)
        logger.warning("could not flush counters: %r", exc)
        return False
    return True


def read() -> dict[str, int]:
    """The shared totals (all processes that flushed), or this process's when Redis is off."""
    target = _client_and_key()
    if target is None:
        return dict(_local)
    client, key = target
    raw = client.hgetall(key)
    return {k.decode() if isinstance(k, bytes) else k: int(v) for k, v in raw.items()}


def local() -> dict[str, int]:
    """Counts made in this process since it started (or the last reset)."""
    with _lock:
        return dict(_local)


def reset(*, shared: bool = False) -> None:
    """Zero the local counts, and with ``shared`` the Redis hash too."""
    with _lock:
        _pending.clear()
        _local.clear()
    if shared and (target := _client_and_key()) is not None:
        client, key = target
        client.delete(key)
