"""Redis ``processed:`` keys through a Django cache (django-redis), written after commit."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from django.core.cache import caches

from idempotent_orders.conf import conf

__all__ = ["RedisLayer", "RedisUnavailable"]

logger = logging.getLogger("idempotent_orders")


class RedisUnavailable(Exception):
    """The cache did not answer; the caller goes to the database instead."""


def _key(consumer: str, message_id: str) -> str:
    return f"processed:{consumer}:{message_id}"


class RedisLayer:
    """Exact "already processed" answers that expire after the dedup window plus a margin.

    After a failure the layer is skipped for ``DEDUP_REDIS_RETRY_AFTER`` seconds,
    so an outage costs one timeout, not one per message.
    """

    def __init__(self) -> None:
        self._down_until = 0.0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(conf.DEDUP_CACHE_ALIAS)

    def _cache(self) -> Any:
        return caches[conf.DEDUP_CACHE_ALIAS]

    def _call(self, op: str, func: Any, *args: Any, **kwargs: Any) -> Any:
        if time.monotonic() < self._down_until:
            raise RedisUnavailable("skipped: failed recently")
        try:
            return func(*args, **kwargs)
        except Exception as exc:  # any client/connection error: Redis is advisory
            with self._lock:
                self._down_until = time.monotonic() + conf.DEDUP_REDIS_RETRY_AFTER
            logger.warning("dedup cache %s failed, using the database: %r", op, exc)
            raise RedisUnavailable(str(exc)) from exc

    def contains(self, consumer: str, message_id: str) -> bool:
        """True when the key exists; raises :class:`RedisUnavailable` when Redis is down."""
        cache = self._cache()
        return bool(self._call("get", cache.get, _key(consumer, message_id)))

    def add(self, consumer: str, message_id: str) -> None:
        """Set the key; only call after the message's transaction committed."""
        cache = self._cache()
        ttl = conf.DEDUP_WINDOW + conf.DEDUP_REDIS_TTL_MARGIN
        self._call("set", cache.set, _key(consumer, message_id), 1, timeout=ttl)

    def reset(self) -> None:
        self._down_until = 0.0
