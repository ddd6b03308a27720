"""FencedLock: owner-only release/extend, fencing tokens the database checks, Redis down raises."""

from __future__ import annotations

import uuid
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.core.cache import caches
from django.test import override_settings
from django_redis import get_redis_connection
from redis.exceptions import NoScriptError, RedisClusterException, ResponseError

from demo_project.models import LoyaltyAccount
from idempotent_orders.exceptions import LockLost, LockNotAcquired, LockUnavailable
from idempotent_orders.locks import FencedLock, fenced_update, locked
from tests.support.services import require_service, wait_until


@pytest.fixture
def name() -> str:
    require_service("redis", settings.REDIS_URL)
    return f"test-{uuid.uuid4().hex}"


def lock_key(name: str) -> str:
    return caches["default"].make_key(f"lock:{{{name}}}")


def test_tokens_grow_with_every_holder(name: str) -> None:
    tokens = []
    for _ in range(3):
        with FencedLock(name, ttl=5) as lock:
            tokens.append(lock.token)
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == 3


def test_busy_lock_times_out(name: str) -> None:
    with FencedLock(name, ttl=5):
        with pytest.raises(LockNotAcquired):
            FencedLock(name, ttl=5, timeout=0.2).acquire()
        with pytest.raises(LockNotAcquired):
            FencedLock(name, ttl=5, timeout=0).acquire()
    # Released: the next caller gets it at once.
    other = FencedLock(name, ttl=5, timeout=0)
    assert other.acquire() > 0
    assert other.release() is True


def test_keys_live_under_the_cache_prefix(name: str) -> None:
    client = get_redis_connection("default")
    with FencedLock(name, ttl=5):
        assert client.exists(lock_key(name))
        assert lock_key(name).startswith(caches["default"].key_prefix)
    assert not client.exists(lock_key(name))


def test_expired_holder_cannot_release_or_extend_the_next_holders_lock(name: str) -> None:
    client = get_redis_connection("default")
    first = FencedLock(name, ttl=0.1)
    first.acquire()
    assert wait_until(lambda: not client.exists(lock_key(name)), timeout=10)
    second = FencedLock(name, ttl=5, timeout=0)
    second.acquire()
    with pytest.raises(LockLost):
        first.extend()
    assert first.release() is False
    assert client.exists(lock_key(name))  # still the second holder's
    second.extend(10)
    assert client.pttl(lock_key(name)) > 5000
    assert second.release() is True


def test_paused_holder_past_its_ttl_cannot_overwrite_newer_work(name: str, db: None) -> None:
    account = LoyaltyAccount.objects.create(customer="carol", points=0)
    rows = LoyaltyAccount.objects.filter(pk=account.pk)
    client = get_redis_connection("default")

    stale = FencedLock(name, ttl=0.2)
    writes: dict[str, int] = {}

    def stale_holder() -> None:
        with stale:
            # The holder stalls (GC pause, swap, a slow call) past its TTL ...
            assert wait_until(lambda: not client.exists(lock_key(name)), timeout=10)
            # ... while a second holder takes the lock and writes newer work.
            with FencedLock(name, ttl=5, timeout=0) as fresh:
                writes["fresh_token"] = fresh.token
                writes["fresh"] = fenced_update(rows, token=fresh.token, points=200)
                writes["again"] = fenced_update(rows, token=fresh.token, points=250)
            # The stale holder wakes up and writes what it computed before the pause.
            writes["stale_token"] = stale.token
            writes["stale"] = fenced_update(rows, token=stale.token, points=100)

    with pytest.raises(LockLost):
        stale_holder()
    assert writes["fresh_token"] > writes["stale_token"]
    # The newer holder wrote (twice, with one token); the stale write was rejected.
    assert (writes["fresh"], writes["again"], writes["stale"]) == (1, 1, 0)
    account.refresh_from_db()
    assert (account.points, account.fence) == (250, writes["fresh_token"])


def test_locked_decorator_passes_the_token(name: str, db: None) -> None:
    account = LoyaltyAccount.objects.create(customer="dave")

    @locked(lambda customer, *a, **kw: f"{name}-{customer}", ttl=5, token_kwarg="fence")
    def set_points(customer: str, points: int, *, fence: int = 0) -> int:
        assert FencedLock(f"{name}-{customer}", timeout=0).token == 0
        with pytest.raises(LockNotAcquired):
            FencedLock(f"{name}-{customer}", timeout=0).acquire()
        return fenced_update(
            LoyaltyAccount.objects.filter(customer=customer), token=fence, points=points
        )

    assert set_points("dave", 7) == 1
    account.refresh_from_db()
    assert account.points == 7
    assert account.fence > 0


def test_redis_unreachable_raises_never_passes() -> None:
    dead = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": "redis://127.0.0.1:1/0",
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 0.5},
    }
    ran = []
    with override_settings(CACHES={**settings.CACHES, "dead": dead}):
        lock = FencedLock("x", cache="dead")
        with pytest.raises(LockUnavailable, match="Redis unreachable"):
            lock.__enter__()

        @locked("x", cache="dead")
        def guarded() -> None:
            ran.append(2)

        with pytest.raises(LockUnavailable):
            guarded()
    assert ran == []


def test_the_keys_share_one_cluster_slot(name: str) -> None:
    from redis.crc import key_slot

    _, key, fence_key = FencedLock(name)._client()
    assert key == caches["default"].make_key(f"lock:{{{name}}}")
    assert fence_key == caches["default"].make_key(f"fence:{{{name}}}")
    assert key_slot(key.encode()) == key_slot(fence_key.encode())


@pytest.mark.parametrize(
    "raised",
    [
        ResponseError("OOM command not allowed when used memory > maxmemory"),
        RedisClusterException("no slot covered"),
        NoScriptError("NOSCRIPT No matching script"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_any_redis_error_is_lock_unavailable(name: str, raised: Exception) -> None:
    lock = FencedLock(name, ttl=5, timeout=0)
    with (
        mock.patch("redis.Redis.eval", side_effect=raised),
        pytest.raises(LockUnavailable, match=type(raised).__name__),
    ):
        lock.acquire()
    assert lock.token == 0


def test_a_cache_that_is_not_redis_is_refused() -> None:
    local: dict[str, Any] = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    with (
        override_settings(CACHES={**settings.CACHES, "local": local}),
        pytest.raises(LockUnavailable, match="not a django-redis cache"),
    ):
        FencedLock("x", cache="local").acquire()


def test_fenced_update_refuses_a_missing_token(db: None) -> None:
    with pytest.raises(ValueError, match="positive"):
        fenced_update(LoyaltyAccount.objects.all(), token=0, points=1)
