"""The dedup fast path on a real local Redis Cluster (3 masters), healthy, with a master
killed and with a master frozen: 0 lost, 0 applied twice, the fast path really used.

The cluster is started once for the module (``redis-server --cluster-enabled yes``
and ``redis-cli --cluster create``); without redis-server the tests skip here
and fail in CI. The storm times are printed (and kept in ``STORM_TIMES``), never
asserted: the machine running the suite is noisy.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.core.cache import caches
from django.test import override_settings
from redis.crc import key_slot

from idempotent_orders import dedup, get_order_model, stats
from idempotent_orders.checks.redis_cluster import check_redis_cluster
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.dedup import Layer
from idempotent_orders.dedup.cluster import ClusterRoute, is_cluster
from idempotent_orders.locks import FencedLock
from idempotent_orders.models import OrderStatus, Outcome, ParkedMessage, ProcessedMessage
from idempotent_orders.signals import dedup_answered
from tests.support.messages import duplicated_storm
from tests.support.services import RedisClusterServers, cluster_cache

# A private cluster per module run; one database leg is enough for the fast path's
# routing (the inbox's guarantee is tested on every leg elsewhere).
pytestmark = pytest.mark.backends("postgresql")

#: Storm wall times (seconds) by scenario, printed at the end of each storm test.
STORM_TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers(masters=3)
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


@pytest.fixture
def on_cluster(cluster: RedisClusterServers) -> Iterator[RedisClusterServers]:
    """The dedup cache (and the lock cache) on the cluster, the default bound and back-off."""
    caches_setting = {**settings.CACHES, "dedup": cluster_cache(cluster.url)}
    values = {
        **settings.IDEMPOTENT_ORDERS,
        "DEDUP_CACHE_ALIAS": "dedup",
        "LOCK_CACHE": "dedup",
        # The defaults (tests/settings.py loosens the bound for the loaded suite).
        "DEDUP_REDIS_TIMEOUT": 0.05,
        "DEDUP_REDIS_RETRY_AFTER": 5,
    }
    with override_settings(CACHES=caches_setting, IDEMPOTENT_ORDERS=values):
        cluster.flushall()
        dedup.reset()
        yield cluster
        dedup.reset()


@pytest.fixture
def answers() -> Iterator[Counter[str]]:
    counted: Counter[str] = Counter()

    def record(sender: Any, layer: Layer, **kwargs: Any) -> None:
        counted[layer.value] += 1

    dedup_answered.connect(record)
    yield counted
    dedup_answered.disconnect(record)


def _route() -> ClusterRoute:
    client = caches["dedup"].client.get_client(write=True)  # type: ignore[attr-defined]
    assert is_cluster(client)
    route = dedup.redis._routes.get(client)
    assert route is not None
    return route


def _counters_master(cluster: RedisClusterServers) -> int:
    """The master holding the counters' hash (idempotent_orders.stats), the worst one to
    lose: they are flushed on the consumers' hot path every STATS_FLUSH_INTERVAL."""
    return cluster.master_of(key_slot(str(caches["dedup"].make_key("stats")).encode()))


def _backoffs() -> int:
    return dedup.redis.backoffs + dedup.redis.cluster_backoffs()


# -- the route ---------------------------------------------------------------------------


def test_keys_spread_over_every_master_and_a_batch_lookup_spans_slots(on_cluster) -> None:
    ids = [f"m-{n}" for n in range(300)]
    dedup.remember_many("payments", ids)
    assert dedup.flush()
    # No key was lost to a redirect: every one is on some master, each master has some.
    per_master = [len(on_cluster.keys(i, "*processed:payments:*")) for i in range(3)]
    assert all(per_master), per_master
    assert sum(per_master) == len(ids)
    # One lookup across every slot and master: no CROSSSLOT, all answered.
    asked = [*ids, "never-1", "never-2"]
    assert dedup.redis.answer_many("payments", asked) == (set(ids), set())
    assert dedup.redis.contains("payments", "m-7")
    assert not dedup.redis.contains("payments", "never-1")
    # The keys carry the window's TTL, written with their replies read.
    key = on_cluster.keys(0, "*processed:payments:*")[0]
    assert 600 < int(on_cluster.cli(on_cluster.ports[0], "TTL", key)) <= 660
    assert _backoffs() == 0


def test_the_fast_path_takes_no_pool_of_the_cluster_client(on_cluster) -> None:
    """The cluster client has no ``connection_pool``: reading it would count as an outage."""
    client = caches["dedup"].client.get_client(write=True)  # type: ignore[attr-defined]
    assert not hasattr(client, "connection_pool")
    dedup.remember("payments", "one")
    assert dedup.redis.contains("payments", "one")
    assert dedup.redis._down_until == 0.0
    assert dedup.redis._pool(caches["dedup"]) is None


def test_a_stale_slot_map_is_read_again_after_a_redirect(on_cluster) -> None:
    dedup.remember("payments", "warm")
    assert dedup.redis.contains("payments", "warm")
    route = _route()
    assert route._slots is not None
    wrong = route._slots[0]
    route._slots = [wrong] * len(route._slots)  # as after a resharding or a failover
    ids = [f"r-{n}" for n in range(30)]
    dedup.remember_many("payments", ids)
    assert dedup.flush()
    # The writes sent to the wrong master were refused (MOVED, read); the map is read
    # again, and the next writes and lookups go to the right masters.
    assert route._slots is None
    dedup.remember_many("payments", ids)
    assert dedup.flush()
    assert dedup.redis.answer_many("payments", ids) == (set(ids), set())
    assert route.backoffs == 0  # a redirect is not an outage


def test_the_counters_are_added_to_their_hash_on_the_cluster(on_cluster) -> None:
    stats.reset(shared=True)
    stats.incr("cluster-probe", 3)
    assert stats.flush()
    stats.incr("cluster-probe", 2)
    assert stats.flush()
    assert stats.read()["cluster-probe"] == 5
    stats.reset(shared=True)


def test_discard_deletes_the_key_on_its_master(on_cluster) -> None:
    dedup.remember("payments", "gone")
    assert dedup.redis.contains("payments", "gone")
    dedup.forget("payments", "gone")
    assert not dedup.redis.contains("payments", "gone")


def test_fenced_lock_works_on_the_cluster(on_cluster) -> None:
    with FencedLock("cluster-lock", ttl=5, timeout=1) as first:
        assert first.token > 0
    with FencedLock("cluster-lock", ttl=5, timeout=1) as second:
        assert second.token > first.token


def test_checks_recognise_the_cluster_client_and_warn_about_one_node(on_cluster) -> None:
    assert check_redis_cluster() == []
    # The stock client pointed at one node of the cluster: the fast path would be skipped.
    stock = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": on_cluster.url,
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 0.5},
    }
    with override_settings(CACHES={**settings.CACHES, "dedup": stock}):
        found = check_redis_cluster()
        assert [m.id for m in found] == ["idempotent_orders.W010"]
        assert "DEDUP_CACHE_ALIAS" in found[0].msg
        assert "ClusterConnectionFactory" in (found[0].hint or "")
        # At run time it is no silent loss either: no reply-less write, the refusals are
        # read, and the fast path is skipped as after an error.
        dedup.reset()
        dedup.remember_many("payments", [f"s-{n}" for n in range(20)])
        assert dedup.flush()
        assert list(dedup.redis._no_reply.values()) == [False]
        assert dedup.redis._down_until > 0
    tagged = cluster_cache(on_cluster.url)
    tagged["KEY_PREFIX"] = "{shop}"
    with override_settings(CACHES={**settings.CACHES, "dedup": tagged}):
        assert [m.id for m in check_redis_cluster()] == ["idempotent_orders.W011"]


# -- storms ------------------------------------------------------------------------------


def _storm(
    seed: int, *, midway: Callable[[], None] | None = None
) -> tuple[float, list[Any], list[tuple[str, dict[str, Any]]]]:
    """Consume a duplicated, shuffled storm (60 orders, 3 messages each, each sent 1-4
    times), in chunks taken by turns through consume_message and consume_batch;
    ``midway`` runs after a third of it. Returns (seconds, orders, deliveries)."""
    Order = get_order_model()
    orders = [
        Order._default_manager.create(
            business_key=f"cluster-{seed}-{n}", amount="12.50", currency="CNY"
        )
        for n in range(60)
    ]
    deliveries = duplicated_storm(orders, seed=seed)
    chunks = [deliveries[i : i + 12] for i in range(0, len(deliveries), 12)]
    dedup.reset()
    started = time.monotonic()
    for n, chunk in enumerate(chunks):
        if midway is not None and n == len(chunks) // 3:
            midway()
        if n % 2:
            for consumer in ("payments", "shipping"):
                batch = [m for c, m in chunk if c == consumer]
                if batch:
                    consume_batch(batch, consumer=consumer)
        else:
            for consumer, message in chunk:
                consume_message(message, consumer=consumer)
    assert dedup.flush()
    return time.monotonic() - started, orders, deliveries


def _assert_exactly_once(orders: list[Any], deliveries: list[tuple[str, dict[str, Any]]]) -> None:
    ids = [o.pk for o in orders]
    distinct = {(c, m["message_id"]) for c, m in deliveries}
    rows = ProcessedMessage.objects.filter(order_id__in=ids)
    # 0 lost: every message is in the inbox, applied; 0 twice: once each, once per order.
    assert rows.count() == len(distinct)
    assert rows.filter(outcome=Outcome.APPLIED).count() == len(distinct)
    for order in get_order_model()._default_manager.filter(pk__in=ids):
        assert order.status == OrderStatus.COMPLETED, order.pk
        assert order.version == 3, order.pk
    assert not ParkedMessage.objects.filter(order_id__in=ids).exists()


def _report(name: str, seconds: float) -> None:
    STORM_TIMES[name] = seconds
    base = STORM_TIMES.get("healthy")
    ratio = f" ({seconds / base:.2f}x healthy)" if base else ""
    print(f"\nredis cluster storm, {name}: {seconds:.2f}s{ratio}")


@pytest.mark.django_db(transaction=True)
def test_storm_on_a_healthy_cluster(on_cluster, answers) -> None:
    # "Never failed" is about the cluster, not the bound: with the default 50 ms, a node
    # that answers late on a loaded machine (three test legs on two cores) counts as down.
    loaded = {**settings.IDEMPOTENT_ORDERS, "DEDUP_REDIS_TIMEOUT": 0.5}
    with override_settings(IDEMPOTENT_ORDERS=loaded):
        dedup.reset()
        seconds, orders, deliveries = _storm(seed=31)
    _assert_exactly_once(orders, deliveries)
    # The fast path answered duplicates itself, from every master, and never failed.
    assert answers[Layer.REDIS_HIT] > 0
    assert answers[Layer.REDIS_DOWN] == 0
    assert all(on_cluster.keys(i, "*processed:*") for i in range(3))
    assert _backoffs() == 0
    _report("healthy", seconds)


@pytest.mark.django_db(transaction=True)
def test_storm_with_a_master_killed_midway(on_cluster, answers) -> None:
    victim = (_counters_master(on_cluster) + 1) % 3  # not the counters' (next test)

    def kill() -> None:
        answers.clear()
        on_cluster.kill(victim)

    try:
        seconds, orders, deliveries = _storm(seed=32, midway=kill)
        _assert_exactly_once(orders, deliveries)
        # The dead master's keys went to the database; the others' stayed on the fast path.
        assert answers[Layer.REDIS_DOWN] > 0
        assert answers[Layer.REDIS_HIT] > 0
        # Each call to it gave up and backed it off (a refused connection), no hang.
        assert _route().backoffs > 0
        assert dedup.redis.backoffs == 0  # the layer as a whole was never skipped
        _report("master killed", seconds)
    finally:
        on_cluster.revive(victim)


@pytest.mark.django_db(transaction=True)
def test_storm_with_a_master_frozen_midway(on_cluster, answers) -> None:
    # The master holding the counters' hash (and the one LOCATION names): the fast path,
    # the counters' flush and the cluster client's own calls all meet it.
    victim = _counters_master(on_cluster)

    def freeze() -> None:
        answers.clear()
        on_cluster.freeze(victim)

    try:
        seconds, orders, deliveries = _storm(seed=33, midway=freeze)
        frozen_backoffs = _route().backoffs
    finally:
        on_cluster.thaw(victim)
    _assert_exactly_once(orders, deliveries)
    assert answers[Layer.REDIS_DOWN] > 0
    assert answers[Layer.REDIS_HIT] > 0
    # Each call that met the frozen master gave up on its own (a timeout, then the
    # back-off): a call that waited for it would still be waiting.
    assert frozen_backoffs > 0
    assert dedup.redis.backoffs == 0
    _report("master frozen", seconds)
