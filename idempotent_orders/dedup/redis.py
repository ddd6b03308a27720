"""Redis ``processed:`` keys through a Django cache (django-redis), written after commit.

The write is sent without waiting for Redis's reply (``CLIENT REPLY SKIP``)
where the cache is django-redis's default client and the server takes that
command: the key is advisory, so a write that never lands only sends the next
copy of the message to the database, and nobody needs to wait for it. The same
pooled connection then serves the next command in order, so this process's own
lookups see the key. A server that refuses ``CLIENT REPLY`` gets the usual
``SET`` and its reply.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

from django.core.cache import caches

from idempotent_orders.conf import conf

__all__ = ["RedisLayer", "RedisUnavailable"]

logger = logging.getLogger("idempotent_orders")


class RedisUnavailable(Exception):
    """The cache did not answer; the caller goes to the database instead."""


#: ``CLIENT REPLY SKIP`` and the head of a five-part ``SET``, in the Redis protocol.
_SKIP_SET = b"*3\r\n$6\r\nCLIENT\r\n$5\r\nREPLY\r\n$4\r\nSKIP\r\n*5\r\n$3\r\nSET\r\n"


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
        #: Whether each connection pool's server takes ``CLIENT REPLY SKIP`` (probed once).
        self._no_reply: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

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

    def contains_many(self, consumer: str, message_ids: list[str]) -> set[str]:
        """The ids whose key exists, asked with one ``MGET``; raises :class:`RedisUnavailable`."""
        cache = self._cache()
        keys = {_key(consumer, m): m for m in message_ids}
        found = self._call("get", cache.get_many, list(keys))
        return {keys[key] for key, value in found.items() if value}

    def add(self, consumer: str, message_id: str) -> None:
        """Set the key; only call after the message's transaction committed."""
        cache = self._cache()
        ttl = conf.DEDUP_WINDOW + conf.DEDUP_REDIS_TTL_MARGIN
        self._call("set", self._set, cache, _key(consumer, message_id), ttl)

    def add_many(self, consumer: str, message_ids: list[str]) -> None:
        """Set the keys of several messages in one send; only call after their commit."""
        cache = self._cache()
        ttl = conf.DEDUP_WINDOW + conf.DEDUP_REDIS_TTL_MARGIN
        keys = [_key(consumer, m) for m in message_ids]
        self._call("set", self._set_many, cache, keys, ttl)

    def _set(self, cache: Any, key: str, ttl: int) -> None:
        self._set_many(cache, [key], ttl)

    def _set_many(self, cache: Any, keys: list[str], ttl: int) -> None:
        pool = self._pool(cache)
        if pool is None or not self._takes_no_reply(pool):
            if len(keys) == 1:
                cache.set(keys[0], 1, timeout=ttl)
            else:
                cache.set_many(dict.fromkeys(keys, 1), timeout=ttl)
            return
        # CLIENT REPLY SKIP, SET <key> 1 EX <ttl> per key, written out in the
        # protocol directly (redis-py packs argument by argument). The value as
        # django-redis stores an int (unserialised), so cache.get reads 1.
        seconds = str(int(ttl)).encode()
        tail = b"\r\n$1\r\n1\r\n$2\r\nEX\r\n$%d\r\n%b\r\n" % (len(seconds), seconds)
        parts: list[bytes] = []
        for key in keys:
            name = str(cache.client.make_key(key)).encode()
            parts.append(_SKIP_SET + b"$%d\r\n%b%b" % (len(name), name, tail))
        connection = pool.get_connection()
        try:
            connection.send_packed_command([b"".join(parts)])
        except BaseException:
            connection.disconnect()  # nothing half-sent stays on a pooled connection
            raise
        finally:
            pool.release(connection)

    @staticmethod
    def _pool(cache: Any) -> Any:
        """The connection pool of a django-redis default client; None for any other cache."""
        try:
            from django_redis.client import DefaultClient
        except ImportError:  # pragma: no cover - the dedup cache is django-redis
            return None
        client: Any = getattr(cache, "client", None)
        if type(client) is not DefaultClient:
            return None
        return client.get_client(write=True).connection_pool

    def _takes_no_reply(self, pool: Any) -> bool:
        known = self._no_reply.get(pool)
        if known is None:
            known = self._no_reply[pool] = self._probe(pool)
        return known

    @staticmethod
    def _probe(pool: Any) -> bool:
        """Whether the server skips the reply of the command after ``CLIENT REPLY SKIP``.

        Sends SKIP, ECHO a, ECHO b: a server that honours SKIP answers only "b".
        Any other answer (an error for a refused or renamed CLIENT command) and
        the connection is dropped, replies unread, so none is left for its next user.
        """
        connection = pool.get_connection()
        ok = False
        try:
            connection.send_packed_command(
                connection.pack_commands(
                    [("CLIENT", "REPLY", "SKIP"), ("ECHO", "skipped"), ("ECHO", "answered")]
                )
            )
            reply = connection.read_response()
            ok = reply in (b"answered", "answered")
        except Exception:
            ok = False
        finally:
            if not ok:
                connection.disconnect()
            pool.release(connection)
        return ok

    def reset(self) -> None:
        self._down_until = 0.0
        self._no_reply.clear()
