"""System checks of the Redis set-up the fast path and the locks run on (W010, W011).

Registered with Django's check framework when :mod:`idempotent_orders.checks`
is imported (the app's ``ready()`` does).

- W010: a cache (``DEDUP_CACHE_ALIAS`` or ``LOCK_CACHE``) whose server is a
  node of a Redis Cluster, reached with a client that is not a cluster client
  (django-redis' stock client pointed at one node): other nodes' keys are
  refused with ``MOVED``, so the fast path is skipped and locks are refused.
  The server is asked ``INFO cluster`` over a connection bounded at 0.5 s; an
  unreachable server says nothing here.
- W011: a cluster client whose cache ``KEY_PREFIX`` holds a hash tag (``{``):
  every key lands in one slot, so one master takes the whole load.

A cluster client (``RedisCluster``, e.g. through
:class:`~idempotent_orders.dedup.cluster.ClusterConnectionFactory`) is the
supported set-up and raises nothing.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Tags, Warning, register

from idempotent_orders.dedup.cluster import is_cluster

__all__ = ["check_redis_cluster"]

#: Seconds the check waits for a server's ``INFO cluster``.
PROBE_TIMEOUT = 0.5

FACTORY = "idempotent_orders.dedup.cluster.ClusterConnectionFactory"


def _aliases() -> dict[str, str]:
    """``alias -> setting`` of the django-redis caches the app uses."""
    from idempotent_orders.conf import conf

    found: dict[str, str] = {}
    try:
        dedup, lock = conf.DEDUP_CACHE_ALIAS, conf.LOCK_CACHE
    except (TypeError, ValueError):
        return found  # E003 already
    caches = getattr(settings, "CACHES", {})
    for alias, setting in ((dedup, "DEDUP_CACHE_ALIAS"), (lock, "LOCK_CACHE")):
        if not alias or alias in found or alias not in caches:
            continue  # off, or E010/E080 report it
        if str(caches[alias].get("BACKEND", "")).startswith("django_redis."):
            found[alias] = setting
    return found


def _redis_client(alias: str) -> Any:
    """The cache's redis-py client for writes, or None when it has none (or fails)."""
    from django.core.cache import caches

    try:
        cache: Any = caches[alias]
        return cache.client.get_client(write=True)
    except Exception:  # unreachable at start-up, or not a django-redis client with one
        return None


def _cluster_node(client: Any) -> bool:
    """Whether the single server ``client`` talks to runs in cluster mode."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return False
    kwargs = dict(pool.connection_kwargs)
    for name in ("socket_timeout", "socket_connect_timeout"):
        value = kwargs.get(name)
        kwargs[name] = PROBE_TIMEOUT if value is None else min(value, PROBE_TIMEOUT)
    connection = pool.connection_class(**kwargs)
    try:
        connection.send_command("INFO", "cluster")
        reply = connection.read_response()
    except Exception:  # unreachable or INFO refused: not known to be a cluster node
        return False
    finally:
        connection.disconnect()
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    return "cluster_enabled:1" in text


@register(Tags.caches)
def check_redis_cluster(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A Redis Cluster reached as one server (W010); a cluster's keys all in one slot (W011)."""
    messages: list[CheckMessage] = []
    caches = getattr(settings, "CACHES", {})
    for alias, setting in _aliases().items():
        client = _redis_client(alias)
        if client is None:
            continue
        if is_cluster(client):
            prefix = str(caches[alias].get("KEY_PREFIX", ""))
            if "{" in prefix:
                messages.append(
                    Warning(
                        f"Cache {alias!r} ({setting}) is a Redis Cluster, but its KEY_PREFIX "
                        f"{prefix!r} holds a hash tag: every key lands in one slot, on one "
                        "master.",
                        hint="Use a KEY_PREFIX without '{' and '}'.",
                        id="idempotent_orders.W011",
                    )
                )
            continue
        if _cluster_node(client):
            messages.append(
                Warning(
                    f"Cache {alias!r} ({setting}) points at one node of a Redis Cluster with "
                    "a client that is not a cluster client: keys of the other nodes' slots "
                    "are refused (MOVED), so the dedup fast path is skipped and locks are "
                    "refused.",
                    hint=f'Set OPTIONS["CONNECTION_FACTORY"] = "{FACTORY}" on that cache '
                    "(see Operations, Redis Cluster).",
                    id="idempotent_orders.W010",
                )
            )
    return messages
