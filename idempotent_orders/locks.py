"""A fenced distributed lock on django-redis: owner-checked release, fencing tokens for the DB."""

from __future__ import annotations

import functools
import random
import secrets
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from django.db import models

from idempotent_orders.conf import conf
from idempotent_orders.exceptions import LockLost, LockNotAcquired, LockUnavailable

__all__ = ["FencedLock", "fenced_update", "locked"]

P = ParamSpec("P")
R = TypeVar("R")

# Take the lock and draw the next fencing token in one step, so a token always
# belongs to exactly one successful acquisition and grows with every holder.
_ACQUIRE = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return redis.call('incr', KEYS[2])
end
return 0
"""
# Release and extend only while we still own the key: after our TTL ran out and
# someone else took the lock, a plain DEL or PEXPIRE would hit *their* lock.
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""
_EXTEND = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""


def _redis_errors() -> tuple[type[BaseException], ...]:
    """Anything the Redis client raises: unreachable, timed out, or a reply that is an
    error (e.g. ``CROSSSLOT`` on a cluster, ``NOSCRIPT``, ``OOM``), cluster errors too."""
    from redis.exceptions import RedisClusterException, RedisError

    return (RedisError, RedisClusterException, OSError)


class FencedLock:
    """Mutual exclusion across processes and machines, with a fencing token.

    ``ttl`` bounds how long a crashed holder blocks others. A holder that is
    paused (GC, swap, a slow call) past its TTL silently loses the lock, so
    mutual exclusion alone cannot protect data: pass :attr:`token` to the
    database and write with :func:`fenced_update`, which rejects a write whose
    token is older than the last one written.

    ``timeout`` is how long :meth:`acquire` waits for a busy lock (0: one try).
    Redis errors raise :class:`LockUnavailable`; the lock never "passes" when
    Redis is down. The fencing counter lives in Redis without a TTL: run Redis
    with persistence and a ``noeviction`` policy (or a prefix no eviction reaches).

    The keys are ``lock:{<name>}`` and ``fence:{<name>}``: the hash tag puts
    both in one slot of a Redis Cluster, so the scripts run there (the cache's
    ``KEY_PREFIX`` must hold no ``{``).
    """

    def __init__(
        self,
        name: str,
        *,
        ttl: float = 30.0,
        timeout: float = 10.0,
        cache: str | None = None,
        poll: float = 0.05,
    ) -> None:
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        self.name = name
        self.ttl = ttl
        self.timeout = timeout
        self.poll = poll
        self.cache_alias = cache
        self.owner = ""
        #: Fencing token of the current holding; 0 when not held.
        self.token = 0

    # Connection and keys are looked up on use so override_settings works.
    def _client(self) -> Any:
        from django.core.cache import caches
        from django_redis import get_redis_connection

        alias = self.cache_alias or conf.LOCK_CACHE
        try:
            client = get_redis_connection(alias)
        except NotImplementedError:
            raise LockUnavailable(
                f"cache {alias!r} is not a django-redis cache; locks need Redis"
            ) from None
        cache = caches[alias]
        tag = f"{{{self.name}}}"
        return client, cache.make_key(f"lock:{tag}"), cache.make_key(f"fence:{tag}")

    def _run(self, script: str, extra: list[Any]) -> int:
        client, key, fence_key = self._client()
        try:
            return int(client.eval(script, 2, key, fence_key, *extra))
        except _redis_errors() as exc:
            from redis.exceptions import ConnectionError, TimeoutError

            if isinstance(exc, ConnectionError | TimeoutError | OSError):
                reason = f"Redis unreachable ({exc})"
            else:
                reason = f"Redis refused the lock's script ({type(exc).__name__}: {exc})"
            raise LockUnavailable(f"lock {self.name!r}: {reason}") from exc

    def acquire(self, timeout: float | None = None) -> int:
        """Take the lock and return its fencing token; raise :class:`LockNotAcquired` on timeout."""
        if self.token:
            raise RuntimeError(f"lock {self.name!r} is already held by this object")
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        owner = secrets.token_hex(16)
        while True:
            token = self._run(_ACQUIRE, [owner, max(1, int(self.ttl * 1000))])
            if token:
                self.owner, self.token = owner, token
                return token
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LockNotAcquired(f"lock {self.name!r} still held after {wait}s")
            # Jitter keeps waiting processes from retrying in lockstep.
            time.sleep(min(remaining, self.poll * (0.5 + random.random())))

    def extend(self, ttl: float | None = None) -> None:
        """Reset the TTL (default: the original one); raise :class:`LockLost` if no longer ours."""
        ms = max(1, int((self.ttl if ttl is None else ttl) * 1000))
        if not self.token or not self._run(_EXTEND, [self.owner, ms]):
            raise LockLost(f"lock {self.name!r} (token {self.token}) is no longer held")

    def release(self) -> bool:
        """Give the lock back; False when it had already expired (another holder may have run)."""
        if not self.token:
            return False
        try:
            return bool(self._run(_RELEASE, [self.owner]))
        finally:
            self.owner, self.token = "", 0

    def __enter__(self) -> FencedLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        token = self.token
        released = self.release()
        # An expired lock means the body may have overlapped another holder.
        # Say so, unless the body is already failing with its own error.
        if not released and exc_type is None:
            raise LockLost(f"lock {self.name!r} (token {token}) expired before release")


def locked(
    name: str | Callable[..., str],
    *,
    ttl: float = 30.0,
    timeout: float = 10.0,
    cache: str | None = None,
    token_kwarg: str | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: run the function under a :class:`FencedLock`.

    ``name`` is fixed or computed from the call's arguments. With
    ``token_kwarg="fence"`` the function receives the fencing token as
    ``fence=...`` to hand to :func:`fenced_update`.
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            lock_name = name(*args, **kwargs) if callable(name) else name
            with FencedLock(lock_name, ttl=ttl, timeout=timeout, cache=cache) as lock:
                if token_kwarg:
                    kwargs[token_kwarg] = lock.token
                return fn(*args, **kwargs)

        return wrapper

    return decorate


def fenced_update(
    queryset: models.QuerySet[Any], *, token: int, fence_field: str = "fence", **values: Any
) -> int:
    """``UPDATE ... SET <values>, fence = :token WHERE <queryset> AND fence <= :token``.

    Returns the number of rows written; 0 means a newer holder has written
    since (or the row is gone) and this holder's work is stale. The same holder
    may write several times with one token.
    """
    if token <= 0:
        raise ValueError("a fencing token is positive; was the lock acquired?")
    return queryset.filter(**{f"{fence_field}__lte": token}).update(
        **values, **{fence_field: token}
    )
