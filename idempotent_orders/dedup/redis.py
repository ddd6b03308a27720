"""Redis ``processed:`` keys through a Django cache (django-redis), written after commit.

The keys are written by a background thread of the process, a batch at a
time (:meth:`RedisLayer.add` only queues the key): the key is advisory, so
a key that appears a few milliseconds later, or never (the process dies
first, Redis is down), only sends a copy of the message to the database,
which still answers exactly. A lookup in this process first writes what is
still queued and waits for a batch being written, so this process's own
lookups see every key it queued before them.

The writes are sent without waiting for Redis's reply (``CLIENT REPLY
SKIP``) where the cache is django-redis's default client and the server
takes that command; a batch ends with one ``PING`` whose reply says Redis
has applied it. Each thread keeps one connection of its own to that server
for these keys, opened with the pool's settings (no pool checkout per
batch, and the commands are packed by hand). A server that refuses
``CLIENT REPLY`` gets the usual ``SET`` and its reply, on that connection.

Every call on that connection (connect, lookup, batch write, the probe) is
bounded by ``DEDUP_REDIS_TIMEOUT`` (its socket timeouts, whatever the
cache's own): a Redis that stopped answering (a frozen process, a network
partition) costs one timeout, then the database answers and Redis is
skipped for ``DEDUP_REDIS_RETRY_AFTER`` seconds, as after an error. A cache
that is not django-redis's default client is reached through the cache,
bounded only by the cache's own ``SOCKET_TIMEOUT``.

A cache whose client is a Redis Cluster client (``RedisCluster``) goes
through :class:`~idempotent_orders.dedup.cluster.ClusterRoute`: each key to
its slot's master, replies read, one ``MGET`` per slot, the same bound per
call, and a master that fails is skipped alone. A single server that turns
out to be a cluster node (a client that is not a cluster client) gets no
reply-less writes: its ``MOVED`` replies are read, logged, and the fast path
is skipped as after an error (system check W010 says so before).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.cache import caches
from django.core.cache.backends.base import default_key_func
from django.core.signals import setting_changed
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.sentinel import SentinelManagedConnection

from idempotent_orders.conf import conf
from idempotent_orders.dedup.cluster import ClusterRoute, NodeDown, is_cluster

__all__ = ["RedisLayer", "RedisUnavailable"]

logger = logging.getLogger("idempotent_orders")


class RedisUnavailable(Exception):
    """The cache did not answer; the caller goes to the database instead."""


def _key(consumer: str, message_id: str) -> str:
    return f"processed:{consumer}:{message_id}"


@dataclass(frozen=True)
class _Target:
    """Where one thread's fast-path calls for the cache alias go, found once."""

    alias: str
    cache: Any
    #: The route to the masters when the cache's client is a Redis Cluster client.
    route: ClusterRoute | None
    #: The connection pool of a django-redis default (or Sentinel) client: the layer's
    #: own connection is opened with its settings. None: through the cache's methods.
    pool: Any
    #: A key as the cache stores it, encoded (with ``pool``).
    raw_key: Callable[[str], bytes] | None = None


def _raw_key(cache: Any, pool: Any) -> Callable[[str], bytes]:
    """How ``cache`` makes and ``pool`` encodes a key: where the cache keeps Django's key
    function and django-redis's ``make_key``, with its prefix and version joined once."""
    from django_redis.client import DefaultClient

    encode = pool.get_encoder().encode
    make_key = cache.client.make_key
    if cache.key_func is default_key_func and type(cache.client).make_key is (
        DefaultClient.make_key
    ):
        head = f"{cache.key_prefix}:{cache.version}:"
        return lambda key: encode(head + key)
    return lambda key: encode(make_key(key))


#: Bumped by every ``setting_changed`` (``CACHES``, ``IDEMPOTENT_ORDERS``, ...) and by
#: :meth:`RedisLayer.reset`: each thread finds its :class:`_Target` again.
_targets_version = [0]


def _forget_targets(**kwargs: Any) -> None:
    _targets_version[0] += 1


setting_changed.connect(_forget_targets, dispatch_uid="idempotent_orders.dedup.redis.targets")


class RedisLayer:
    """Exact "already processed" answers that expire after the dedup window plus a margin.

    After a failure the layer is skipped for ``DEDUP_REDIS_RETRY_AFTER`` seconds,
    so an outage costs one timeout, not one per message.
    """

    #: Seconds the writer thread waits, once woken, for more keys to write them as one batch.
    linger = 0.005
    #: Keys queued beyond this many are dropped (their copies go to the database).
    capacity = 10_000
    #: Seconds the process waits at exit for the queued keys to be written.
    exit_timeout = 2.0

    def __init__(self) -> None:
        self._down_until = 0.0
        #: Whether each connection pool's server takes ``CLIENT REPLY SKIP`` (probed once).
        self._no_reply: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        #: This thread's own connection: ``(pool, connection, pid)``.
        self._own = threading.local()
        #: The route of each Redis Cluster client met (see :mod:`.cluster`).
        self._routes: weakref.WeakKeyDictionary[Any, ClusterRoute] = weakref.WeakKeyDictionary()
        #: How many times the whole layer was backed off after a failure.
        self.backoffs = 0
        self._start_fresh()
        self._exit_hook = False
        os.register_at_fork(after_in_child=self._start_fresh)

    def _start_fresh(self) -> None:
        """No queue and no writer thread (at creation, and in a forked child: its locks
        may have been held by a thread of the parent that the child does not have)."""
        self._lock = threading.Lock()
        #: Queued keys: ``(cache alias, key, ttl)``.
        self._queued: list[tuple[str, str, int]] = []
        self._queue_lock = threading.Lock()
        #: Held while keys taken from the queue are written, until Redis has applied them.
        self._writing = threading.Lock()
        self._wake = threading.Event()
        self._writer: threading.Thread | None = None
        self._stopping = False

    @property
    def enabled(self) -> bool:
        return bool(conf.DEDUP_CACHE_ALIAS)

    def _target(self) -> _Target:
        """This thread's :class:`_Target` for ``DEDUP_CACHE_ALIAS``.

        Found once per thread and settings: looking the cache, its client and
        its pool up again costs more than the GET a duplicate is answered with.
        """
        alias = conf.DEDUP_CACHE_ALIAS
        known = getattr(self._own, "target", None)
        if known is not None and known[0] == _targets_version[0] and known[1].alias == alias:
            target: _Target = known[1]
            return target
        version = _targets_version[0]
        cache = caches[alias]
        route = self._call("get", self._route, cache)
        pool = None if route is not None else self._call("get", self._pool, cache)
        raw_key = None if pool is None else _raw_key(cache, pool)
        target = _Target(alias, cache, route, pool, raw_key)
        self._own.target = (version, target)
        return target

    def _call(self, op: str, func: Any, *args: Any, **kwargs: Any) -> Any:
        if time.monotonic() < self._down_until:
            raise RedisUnavailable("skipped: failed recently")
        try:
            return func(*args, **kwargs)
        except NodeDown as exc:  # one cluster master, already backed off on its own
            raise RedisUnavailable(str(exc)) from exc
        except Exception as exc:  # any client/connection error: Redis is advisory
            with self._lock:
                self._down_until = time.monotonic() + conf.DEDUP_REDIS_RETRY_AFTER
                self.backoffs += 1
            logger.warning("dedup cache %s failed, using the database: %r", op, exc)
            raise RedisUnavailable(str(exc)) from exc

    def contains(self, consumer: str, message_id: str) -> bool:
        """True when the key exists; raises :class:`RedisUnavailable` when Redis is down.

        What this process queued before is written first, so it is seen.
        """
        self.flush()
        target = self._target()
        key = _key(consumer, message_id)
        if target.route is not None:
            found, unanswered = self._call("get", target.route.lookup, [_raw(target.cache, key)])
            if unanswered:
                raise RedisUnavailable("its cluster node did not answer")
            return bool(found)
        if target.raw_key is None:
            return bool(self._call("get", target.cache.get, key))
        return bool(self._call("get", self._get, target, key))

    def _get(self, target: _Target, key: str) -> bool:
        packed = _pack(b"GET", target.raw_key(key))  # type: ignore[misc]
        return self._send(target.pool, packed, read=True) is not None

    def contains_many(self, consumer: str, message_ids: list[str]) -> set[str]:
        """The ids whose key exists, asked with one ``MGET``; raises :class:`RedisUnavailable`
        (on a cluster: when a master holding one of them did not answer)."""
        found, unanswered = self.answer_many(consumer, message_ids)
        if unanswered:
            raise RedisUnavailable(f"{len(unanswered)} key(s) not answered")
        return found

    def answer_many(self, consumer: str, message_ids: list[str]) -> tuple[set[str], set[str]]:
        """``(found, unanswered)``: the ids whose key exists, and those Redis did not answer
        for (on a cluster, the ids of a master that failed; the others are answered).
        Raises :class:`RedisUnavailable` when Redis answered for none."""
        self.flush()
        target = self._target()
        keys = {_key(consumer, m): m for m in message_ids}
        if target.route is not None:
            raw = {_raw(target.cache, key): m for key, m in keys.items()}
            hits, unanswered = self._call("get", target.route.lookup, list(raw))
            if unanswered and len(unanswered) == len(raw):
                raise RedisUnavailable("no cluster node answered")
            return {raw[k] for k in hits}, {raw[k] for k in unanswered}
        return self._contains_many(target, keys), set()

    def _contains_many(self, target: _Target, keys: dict[str, str]) -> set[str]:
        if target.pool is None:
            found = self._call("get", target.cache.get_many, list(keys))
            return {keys[key] for key, value in found.items() if value}
        values = self._call("get", self._get_many, target, list(keys))
        return {keys[key] for key, value in zip(keys, values, strict=True) if value is not None}

    def add(self, consumer: str, message_id: str) -> None:
        """Queue the key for the writer thread; only call after the message's transaction
        committed (and its work is done)."""
        self.add_many(consumer, [message_id])

    def add_many(self, consumer: str, message_ids: list[str]) -> None:
        """:meth:`add` for several messages (written in the same batch)."""
        alias = conf.DEDUP_CACHE_ALIAS
        ttl = conf.DEDUP_WINDOW + conf.DEDUP_REDIS_TTL_MARGIN
        if self._writer is None:
            self._start_writer()
        with self._queue_lock:
            room = self.capacity - len(self._queued)
            self._queued.extend((alias, _key(consumer, m), ttl) for m in message_ids[:room])
        if room < len(message_ids):
            logger.debug("dedup keys: queue full; %d key(s) not written", len(message_ids) - room)
        if not self._wake.is_set():
            self._wake.set()

    def discard(self, consumer: str, message_id: str) -> None:
        """Take ``message_id`` back: out of the queue, and its key deleted (a message
        recorded as handled that turned out to fail must reach the database again)."""
        key = _key(consumer, message_id)
        with self._writing, self._queue_lock:
            self._queued = [q for q in self._queued if q[1] != key]
        try:
            cache = caches[conf.DEDUP_CACHE_ALIAS]
            route = self._route(cache)
            if route is not None:
                route.delete(_raw(cache, key))
            else:
                cache.delete(key)
        except Exception:  # advisory: the inbox row says failed, whatever Redis says
            logger.warning("dedup keys: could not delete %s", key, exc_info=True)

    def flush(self, timeout: float = -1) -> bool:
        """Write the queued keys now, in this thread, after a batch being written;
        False when that batch was not done within ``timeout`` seconds (-1: no limit).

        Once it returns True, Redis has applied every key queued before the
        call (or their write failed, which only sends their copies to the database).
        """
        if not self._writing.acquire(timeout=timeout):
            return False
        try:
            with self._queue_lock:
                batch, self._queued = self._queued, []
            if batch:
                self._write(batch)
        finally:
            self._writing.release()
        return True

    def _write(self, batch: list[tuple[str, str, int]]) -> None:
        """Write ``batch`` (holding ``_writing``); a failure is logged and marks Redis down."""
        groups: defaultdict[tuple[str, int], list[str]] = defaultdict(list)
        for alias, key, ttl in batch:
            groups[alias, ttl].append(key)
        for (alias, ttl), keys in groups.items():
            try:
                self._call("set", self._set_many, caches[alias], keys, ttl)
            except RedisUnavailable:
                pass  # logged; these keys' copies go to the database
            except Exception:  # e.g. a cache alias gone from the settings since
                logger.exception("dedup keys: could not write %d key(s)", len(keys))

    def _start_writer(self) -> None:
        with self._lock:
            if self._writer is not None:
                return
            self._stopping = False
            self._writer = threading.Thread(
                target=self._run, name="idempotent-orders-dedup-keys", daemon=True
            )
            self._writer.start()
            if not self._exit_hook:
                atexit.register(self._stop)
                self._exit_hook = True

    def _run(self) -> None:
        wake = self._wake
        while not self._stopping:
            wake.wait()
            # Keys keep coming while a consumer is busy: one batch takes what came meanwhile.
            time.sleep(self.linger)
            wake.clear()  # before taking the queue: a key queued after this wakes us again
            try:
                self.flush()
            except Exception:  # the thread must not die; the keys are advisory
                logger.exception("dedup keys: writer failed")

    def _stop(self) -> None:
        writer = self._writer
        if writer is None or not writer.is_alive():
            return
        self._stopping = True
        self._wake.set()
        writer.join(self.exit_timeout)
        self.flush(self.exit_timeout)

    def _set_many(self, cache: Any, keys: list[str], ttl: int) -> None:
        route = self._route(cache)
        if route is not None:
            route.write([_raw(cache, key) for key in keys], ttl)
            return
        pool = self._pool(cache)
        if pool is None:
            if len(keys) == 1:
                cache.set(keys[0], 1, timeout=ttl)
            else:
                cache.set_many(dict.fromkeys(keys, 1), timeout=ttl)
            return
        # The value as django-redis stores an int (unserialised), so cache.get reads 1.
        connection = self._connection(pool)
        encode = connection.encoder.encode
        expiry = b"%d" % int(ttl)
        make_key = cache.client.make_key
        sets = [_pack(b"SET", encode(make_key(key)), b"1", b"EX", expiry) for key in keys]
        if not self._takes_no_reply(pool):
            # One reply per SET, all read: nothing left unread on the connection.
            self._send(pool, b"".join(sets), read=True, replies=len(sets))
            return
        # The PING's reply comes once Redis applied every SET before it.
        self._send(pool, b"".join(_SKIP + packed for packed in sets) + _PING, read=True)

    def _get_many(self, target: _Target, keys: list[str]) -> list[Any]:
        connection = self._connection(target.pool)
        encode = connection.encoder.encode
        make_key = target.cache.client.make_key
        packed = _pack(b"MGET", *(encode(make_key(key)) for key in keys))
        return list(self._send(target.pool, packed, read=True))

    def _send(self, pool: Any, packed: bytes, *, read: bool, replies: int = 1) -> Any:
        """Send ``packed`` on this thread's connection (and read ``replies`` replies when
        ``read``, returning the last).

        A connection the server closed since its last use (a Redis restart, an
        idle timeout) fails on use: it is dropped and the command sent once
        more on a new one. A timeout (Redis did not answer within
        ``DEDUP_REDIS_TIMEOUT``) is not retried. Any failure drops the
        connection, so nothing half-sent or unread stays on it.
        """
        for attempt in (1, 2):
            connection = self._connection(pool)
            try:
                connection.send_packed_command([packed], check_health=False)
                reply = None
                for _ in range(replies if read else 0):
                    reply = connection.read_response()
                return reply
            except (ConnectionError, OSError, RedisConnectionError):
                self._drop()
                if attempt == 2:
                    raise
            except BaseException:
                self._drop()
                raise
        return None  # pragma: no cover - the loop returns or raises

    def _connection(self, pool: Any) -> Any:
        """This thread's own connection to ``pool``'s server, opened with the pool's settings.

        Kept per thread (a connection serves one command stream at a time) and
        per process (a forked child opens its own). Its socket timeouts are at
        most ``DEDUP_REDIS_TIMEOUT``, so no call on it waits longer for Redis.
        """
        own = self._own
        current = getattr(own, "current", None)
        pid = os.getpid()
        bound = conf.DEDUP_REDIS_TIMEOUT
        if current is not None and current[0] is pool and current[2:] == (pid, bound):
            return current[1]
        self._drop()
        kwargs = dict(pool.connection_kwargs)
        for name in ("socket_timeout", "socket_connect_timeout"):
            value = kwargs.get(name)
            kwargs[name] = bound if value is None else min(value, bound)
        connection = pool.connection_class(**kwargs)
        if isinstance(connection, SentinelManagedConnection):
            # Its own connect() asks the sentinels for the master; a send would not.
            connection.connect()
        own.current = (pool, connection, pid, bound)
        return connection

    def _drop(self) -> None:
        current = getattr(self._own, "current", None)
        self._own.current = None
        if current is not None and current[2] == os.getpid():
            current[1].disconnect()

    @staticmethod
    def _pool(cache: Any) -> Any:
        """The connection pool of a django-redis default (or Sentinel) client; None for
        any other cache."""
        try:
            from django_redis.client import DefaultClient, SentinelClient
        except ImportError:  # pragma: no cover - the dedup cache is django-redis
            return None
        client: Any = getattr(cache, "client", None)
        if type(client) not in (DefaultClient, SentinelClient):
            return None
        redis_client = client.get_client(write=True)
        if is_cluster(redis_client):
            return None  # reached through its route, never its (absent) pool
        return redis_client.connection_pool

    def _route(self, cache: Any) -> ClusterRoute | None:
        """The route to the masters when the cache's client is a Redis Cluster client."""
        try:
            from django_redis.client import DefaultClient
        except ImportError:  # pragma: no cover - the dedup cache is django-redis
            return None
        client: Any = getattr(cache, "client", None)
        if not isinstance(client, DefaultClient):
            return None
        redis_client = client.get_client(write=True)
        if not is_cluster(redis_client):
            return None
        route = self._routes.get(redis_client)
        if route is None:
            with self._lock:
                route = self._routes.setdefault(redis_client, ClusterRoute(redis_client))
        return route

    def add_counts(self, cache: Any, key: str, counts: dict[str, int]) -> bool:
        """Add ``counts`` to the hash ``key`` (made with the cache's prefix) on a Redis
        Cluster, bounded as a fast-path call; False when the cache is not a cluster (the
        caller writes them its own way). Raises :class:`RedisUnavailable` when the
        hash's master failed or is skipped after failing."""
        route = self._call("set", self._route, cache)
        if route is None:
            return False
        self._call("set", route.add_counts, str(key).encode(), counts)
        return True

    def cluster_backoffs(self) -> int:
        """How many times a cluster master was backed off, in this process."""
        return sum(route.backoffs for route in list(self._routes.values()))

    def _takes_no_reply(self, pool: Any) -> bool:
        known = self._no_reply.get(pool)
        if known is None:
            known = self._no_reply[pool] = self._probe(pool)
        return known

    def _probe(self, pool: Any) -> bool:
        """Whether the server skips the reply of the command after ``CLIENT REPLY SKIP``.

        Sends SKIP, ECHO a, ECHO b on this thread's (bounded) connection: a
        server that honours SKIP answers only "b". An error reply (a refused or
        renamed CLIENT command) or another answer is a no, and the connection
        is dropped, replies unread, so none is left for its next command. No
        answer at all (a timeout, a refused connection) is not an answer: it
        raises, nothing is remembered, and the next batch probes again.
        """
        connection = self._connection(pool)
        ok = False
        try:
            connection.send_packed_command(
                connection.pack_commands(
                    [("CLIENT", "REPLY", "SKIP"), ("ECHO", "skipped"), ("ECHO", "answered")]
                )
            )
            reply = connection.read_response()
            ok = reply in (b"answered", "answered")
            if ok and _cluster_node(connection):
                # Its MOVED replies must be read: no reply-less writes to a cluster node.
                ok = False
                logger.error(
                    "dedup cache %r is a node of a Redis Cluster, but its client is not a "
                    "cluster client: keys of other nodes' slots are refused (MOVED) and "
                    "the fast path is skipped (system check idempotent_orders.W010)",
                    conf.DEDUP_CACHE_ALIAS,
                )
        except ResponseError:
            ok = False
        finally:
            if not ok:
                self._drop()
        return ok

    def reset(self) -> None:
        """Drop the queued keys (after any batch being written) and forget the back-off."""
        with self._writing, self._queue_lock:
            self._queued.clear()
        self._down_until = 0.0
        self.backoffs = 0
        self._no_reply.clear()
        _forget_targets()
        self._drop()
        for route in list(self._routes.values()):
            route.close()


def _cluster_node(connection: Any) -> bool:
    """Whether the server on ``connection`` runs in cluster mode (``INFO cluster``)."""
    connection.send_packed_command([_pack(b"INFO", b"cluster")], check_health=False)
    try:
        reply = connection.read_response()
    except ResponseError:  # INFO refused or renamed: not known to be a cluster node
        return False
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    return "cluster_enabled:1" in text


def _raw(cache: Any, key: str) -> bytes:
    """``key`` as django-redis stores it (with the cache's prefix and version), encoded."""
    return str(cache.client.make_key(key)).encode()


def _pack(*parts: bytes) -> bytes:
    """One Redis command in the protocol's wire form."""
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


_SKIP = _pack(b"CLIENT", b"REPLY", b"SKIP")
_PING = _pack(b"PING")
