"""The fast path on a Redis Cluster: keys routed to their master, each call bounded.

A django-redis cache whose client is a :class:`redis.cluster.RedisCluster`
(:class:`ClusterConnectionFactory` builds one; a client class of your own
that returns one from ``get_client()`` works too) is reached through a
:class:`ClusterRoute`:

- each ``processed:`` key goes to the master that holds its slot, read from
  ``CLUSTER SLOTS``; the map is read again after a ``MOVED`` or ``ASK``
  reply (a failover, a resharding), so a key is never lost to a redirect;
- the writes are plain ``SET``\\s whose replies are read (no ``CLIENT REPLY
  SKIP``: a redirect must be seen);
- a batch lookup is one ``MGET`` per slot, pipelined per master: the masters
  are all sent their commands first, then read, so the batch costs one round
  trip whatever the number of masters, and never fails across slots;
- every call to a master uses a connection of this thread's own, opened with
  the cluster's connection settings and socket timeouts of at most
  ``DEDUP_REDIS_TIMEOUT``: a master that stopped answering (frozen, cut off)
  costs one timeout, then the database decides for its keys and that master
  alone is skipped for ``DEDUP_REDIS_RETRY_AFTER`` seconds (the others keep
  answering for theirs).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from django_redis.pool import ConnectionFactory
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from idempotent_orders.conf import conf

__all__ = ["ClusterConnectionFactory", "ClusterRoute", "NodeDown", "is_cluster"]

logger = logging.getLogger("idempotent_orders")

Address = tuple[str, int]

#: Slots of a Redis Cluster.
SLOTS = 16384


def is_cluster(client: Any) -> bool:
    """Whether ``client`` (a redis-py client) is a Redis Cluster client."""
    try:
        from redis.cluster import RedisCluster
    except ImportError:  # pragma: no cover - redis-py has it since 4.1
        return False
    return isinstance(client, RedisCluster)


class NodeDown(Exception):
    """A master did not answer, or is skipped after failing recently."""


class ClusterConnectionFactory(ConnectionFactory):
    """A django-redis connection factory whose clients are ``RedisCluster``\\s.

    ``OPTIONS = {"CONNECTION_FACTORY":
    "idempotent_orders.dedup.cluster.ClusterConnectionFactory"}``: ``LOCATION``
    names one node of the cluster (``redis://host:port``; the others are
    discovered), ``SOCKET_TIMEOUT``, ``SOCKET_CONNECT_TIMEOUT``, ``PASSWORD``
    and ``REDIS_CLIENT_KWARGS`` go to the cluster client. One client per URL
    and process, shared by the threads (it keeps a pool per node). Its
    commands (the counters, the locks; the fast path has its own) are tried
    once, not retried with backoff (``REDIS_CLIENT_KWARGS={"retry": ...}``
    says otherwise): a master that stopped answering costs one
    ``SOCKET_TIMEOUT``.
    """

    _clusters: dict[tuple[str, int], Any] = {}
    _lock = threading.Lock()

    def get_connection(self, params: dict[str, Any]) -> Any:
        from redis.cluster import RedisCluster

        key = (params["url"], os.getpid())
        with self._lock:
            client = self._clusters.get(key)
            if client is None:
                kwargs = {k: v for k, v in params.items() if k not in ("url", "parser_class")}
                # One attempt per command: redis-py's default (3 retries with backoff)
                # turns a frozen master into seconds per call for the counters and locks.
                kwargs["retry"] = Retry(NoBackoff(), 0)
                kwargs.update(getattr(self, "redis_client_cls_kwargs", {}))
                client = RedisCluster.from_url(params["url"], **kwargs)
                self._clusters[key] = client
        return client

    def disconnect(self, connection: Any) -> None:
        connection.close()


class ClusterRoute:
    """The fast path's commands to the masters of one cluster client (see the module).

    Thread-safe: each thread keeps its own connection per master.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        #: Master of each slot; None until read (and after a redirect).
        self._slots: list[Address] | None = None
        self._seeds: list[Address] = []
        #: Masters that failed recently: address -> monotonic time they are asked again.
        self._down: dict[Address, float] = {}
        #: How many times a master was backed off (a failure, a timeout, an error reply).
        self.backoffs = 0
        self._lock = threading.Lock()
        self._own = threading.local()

    # -- topology -------------------------------------------------------------------

    def _connection_settings(self) -> tuple[type, dict[str, Any]]:
        """The connection class and settings of the cluster client's nodes."""
        for node in self.client.get_nodes():
            redis = getattr(node, "redis_connection", None)
            pool = getattr(redis, "connection_pool", None)
            if pool is not None:
                return pool.connection_class, dict(pool.connection_kwargs)
        raise NodeDown("the cluster client knows no node")

    def _addresses(self) -> list[Address]:
        known = list(dict.fromkeys(self._slots or []))
        known += [(str(n.host), int(n.port)) for n in self.client.get_nodes()]
        known += self._seeds
        return list(dict.fromkeys(known))

    def _refresh(self) -> list[Address]:
        """Read the slots' masters from the first node that answers ``CLUSTER SLOTS``."""
        now = time.monotonic()
        for address in self._addresses():
            if self._down.get(address, 0.0) > now:
                continue
            try:
                reply = self._exchange(address, [("CLUSTER", "SLOTS")])[0]
            except NodeDown:
                continue
            if isinstance(reply, ResponseError):
                self._back_off(address, reply)
                continue
            slots: list[Address] = [("", 0)] * SLOTS
            for entry in reply:
                start, end, master = int(entry[0]), int(entry[1]), entry[2]
                host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                for slot in range(start, end + 1):
                    slots[slot] = (host or address[0], int(master[1]))
            with self._lock:
                self._slots = slots
                self._seeds = list(dict.fromkeys(slots))
            return slots
        raise NodeDown("no node of the cluster answered CLUSTER SLOTS")

    def _master(self, key: bytes) -> Address:
        slots = self._slots or self._refresh()
        address = slots[key_slot(key)]
        if not address[1]:
            raise NodeDown(f"slot {key_slot(key)} has no master")
        return address

    def forget_slots(self) -> None:
        """Read the slot map again at the next call (after a redirect)."""
        with self._lock:
            self._slots = None

    # -- connections ----------------------------------------------------------------

    def _connection(self, address: Address) -> Any:
        own: dict[Address, tuple[Any, int, float]] = getattr(self._own, "connections", None) or {}
        self._own.connections = own
        pid, bound = os.getpid(), conf.DEDUP_REDIS_TIMEOUT
        current = own.get(address)
        if current is not None and current[1:] == (pid, bound):
            return current[0]
        self._drop(address)
        connection_class, kwargs = self._connection_settings()
        kwargs["host"], kwargs["port"] = address
        for name in ("socket_timeout", "socket_connect_timeout"):
            value = kwargs.get(name)
            kwargs[name] = bound if value is None else min(value, bound)
        connection = connection_class(**kwargs)
        own[address] = (connection, pid, bound)
        return connection

    def _drop(self, address: Address) -> None:
        own: dict[Address, tuple[Any, int, float]] = getattr(self._own, "connections", None) or {}
        current = own.pop(address, None)
        if current is not None and current[1] == os.getpid():
            current[0].disconnect()

    def close(self) -> None:
        """Drop this thread's connections; forget the back-offs, their count and the slots."""
        for address in list(getattr(self._own, "connections", None) or {}):
            self._drop(address)
        with self._lock:
            self._down.clear()
            self._slots = None
            self.backoffs = 0

    def _back_off(self, address: Address, why: Any) -> None:
        with self._lock:
            self._down[address] = time.monotonic() + conf.DEDUP_REDIS_RETRY_AFTER
            self.backoffs += 1
        logger.warning(
            "dedup cache: cluster node %s:%d failed, using the database for its keys: %r",
            *address,
            why,
        )

    def is_down(self, address: Address) -> bool:
        return self._down.get(address, 0.0) > time.monotonic()

    # -- commands -------------------------------------------------------------------

    def _exchange(self, address: Address, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` to one node and read their replies (an error reply is
        returned as its exception); :class:`NodeDown` when the node does not answer."""
        return self._run({address: commands})[address]

    def _run(self, batches: dict[Address, list[tuple[Any, ...]]]) -> dict[Address, Any]:
        """Send each node its commands, then read every reply: ``address -> replies`` for
        the nodes that answered. A node that fails is backed off and left out; a
        :class:`NodeDown` is raised only when ``batches`` has one node and it failed.
        """
        sent: dict[Address, Any] = {}
        for address, commands in batches.items():
            if self.is_down(address):
                continue
            connection = None
            try:
                connection = self._connection(address)
                connection.send_packed_command(
                    connection.pack_commands(commands), check_health=False
                )
                sent[address] = connection
            except (OSError, RedisConnectionError, RedisTimeoutError) as exc:
                self._drop(address)
                self._back_off(address, exc)
        replies: dict[Address, Any] = {}
        for address, connection in sent.items():
            out: list[Any] = []
            try:
                for _ in batches[address]:
                    try:
                        out.append(connection.read_response())
                    except ResponseError as exc:  # read whole: the stream stays in step
                        out.append(exc)
            except BaseException as exc:
                self._drop(address)
                if not isinstance(exc, OSError | RedisConnectionError | RedisTimeoutError):
                    raise
                self._back_off(address, exc)
                continue
            replies[address] = out
        if len(batches) == 1 and not replies:
            raise NodeDown(f"{next(iter(batches))} did not answer")
        return replies

    def _redirected(self, address: Address, reply: Any) -> bool:
        """Whether an error ``reply`` is a redirect (the map is read again); any other
        error reply (``CLUSTERDOWN``, ``TRYAGAIN``, ``LOADING``...) backs the node off."""
        text = str(reply)
        if text.startswith(("MOVED", "ASK")) or type(reply).__name__ in ("MovedError", "AskError"):
            self.forget_slots()
            return True
        self._back_off(address, reply)
        return False

    def lookup(self, keys: list[bytes]) -> tuple[set[bytes], set[bytes]]:
        """``(found, unanswered)``: the keys that exist, and those no master answered for
        (their messages go to the database). One ``MGET`` per slot."""
        by_node: dict[Address, dict[int, list[bytes]]] = {}
        unanswered: set[bytes] = set()
        for key in keys:
            try:
                address = self._master(key)
            except NodeDown:
                unanswered.add(key)
                continue
            by_node.setdefault(address, {}).setdefault(key_slot(key), []).append(key)
        batches = {
            address: [("MGET", *group) for group in slots.values()]
            for address, slots in by_node.items()
        }
        replies = self._run_one(batches)
        found: set[bytes] = set()
        for address, slots in by_node.items():
            groups = list(slots.values())
            answer = replies.get(address)
            if answer is None:
                unanswered.update(k for group in groups for k in group)
                continue
            redirected = False
            for group, values in zip(groups, answer, strict=True):
                if isinstance(values, ResponseError):
                    if not redirected:
                        redirected = self._redirected(address, values) or redirected
                    unanswered.update(group)
                    continue
                found.update(k for k, v in zip(group, values, strict=True) if v is not None)
        return found, unanswered

    def _run_one(self, batches: dict[Address, list[tuple[Any, ...]]]) -> dict[Address, Any]:
        try:
            return self._run(batches)
        except NodeDown:
            return {}

    def write(self, keys: list[bytes], ttl: int) -> int:
        """``SET key 1 EX ttl`` for each key on its master, replies read; how many
        were written (the others' copies go to the database)."""
        by_node: dict[Address, list[bytes]] = {}
        for key in keys:
            try:
                by_node.setdefault(self._master(key), []).append(key)
            except NodeDown:
                continue
        batches = {
            address: [("SET", key, b"1", "EX", int(ttl)) for key in group]
            for address, group in by_node.items()
        }
        written = 0
        for address, answer in self._run_one(batches).items():
            redirected = False
            for reply in answer:
                if isinstance(reply, ResponseError):
                    if not redirected:
                        redirected = self._redirected(address, reply) or redirected
                    continue
                written += 1
        return written

    def add_counts(self, key: bytes, counts: dict[str, int]) -> None:
        """``HINCRBY key name amount`` for each count, on the hash's master; raises
        :class:`NodeDown` when it did not answer or refused (the counts are kept)."""
        address = self._master(key)
        commands = [("HINCRBY", key, name, int(amount)) for name, amount in counts.items()]
        for reply in self._exchange(address, commands):
            if isinstance(reply, ResponseError):
                self._redirected(address, reply)
                raise NodeDown(str(reply))

    def delete(self, key: bytes) -> None:
        reply = self._exchange(self._master(key), [("DEL", key)])[0]
        if isinstance(reply, ResponseError):
            self._redirected(self._master(key), reply)
            raise NodeDown(str(reply))
