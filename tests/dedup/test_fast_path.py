"""The duplicate's road: what it costs is cut, what it answers and counts is not."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from idempotent_orders import dedup, stats
from idempotent_orders.consuming import single
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.dedup import Layer
from idempotent_orders.dedup.bloom import BloomLayer
from idempotent_orders.dedup.redis import RedisLayer
from idempotent_orders.models import Outcome, ProcessedMessage
from idempotent_orders.signals import dedup_answered, message_consumed
from tests.support.messages import payment


@pytest.fixture(params=["memory-hit", "redis-hit"])
def copy_layer(request: pytest.FixtureRequest) -> str:
    """Where the copy arrives: at the process that handled the message (its memory
    answers), or at another one (Redis answers)."""
    return str(request.param)


def reach(copy_layer: str) -> None:
    """Send the copy where ``copy_layer`` says (another process: this one forgets)."""
    if copy_layer == "redis-hit":
        dedup.memory.clear()


@pytest.fixture
def heard() -> Iterator[list[tuple[str, Any]]]:
    """What ``dedup_answered`` and ``message_consumed`` said, in order."""
    said: list[tuple[str, Any]] = []

    def on_layer(sender: Any, layer: Layer, **kwargs: Any) -> None:
        said.append(("layer", layer.value))

    def on_consumed(sender: Any, outcome: Any, reason: str, **kwargs: Any) -> None:
        said.append(("consumed", (str(outcome), reason, kwargs["message_type"])))

    dedup_answered.connect(on_layer)
    message_consumed.connect(on_consumed)
    yield said
    dedup_answered.disconnect(on_layer)
    message_consumed.disconnect(on_consumed)


@pytest.mark.django_db(transaction=True)
def test_a_copy_the_fast_path_knows_is_answered_from_its_id_alone(
    make_order, redis_server, monkeypatch, copy_layer
) -> None:
    msg = payment(make_order())
    assert consume_message(msg, consumer="payments") is Outcome.APPLIED
    assert dedup.flush()
    reach(copy_layer)
    stats.reset()
    # Only the built-in counters listen: the rest of the message is never read.
    monkeypatch.setattr(single, "parse_envelope", mock.Mock(side_effect=AssertionError("parsed")))
    with CaptureQueriesContext(connection) as queries:
        assert consume_message(msg, consumer="payments") is Outcome.DUPLICATE
    assert len(queries) == 0
    assert stats.local() == {f"layer:{copy_layer}": 1, "outcome:duplicate": 1}


@pytest.mark.django_db(transaction=True)
def test_a_receiver_hears_a_fast_path_copy_with_its_type_and_order(
    make_order, redis_server, heard, copy_layer
) -> None:
    order = make_order()
    msg = payment(order)
    assert consume_message(msg, consumer="payments") is Outcome.APPLIED
    assert dedup.flush()
    reach(copy_layer)
    orders: list[Any] = []

    def on_consumed(sender: Any, order_id: Any, **kwargs: Any) -> None:
        orders.append(order_id)

    message_consumed.connect(on_consumed)
    heard.clear()
    try:
        with CaptureQueriesContext(connection) as queries:
            assert consume_message(msg, consumer="payments") is Outcome.DUPLICATE
    finally:
        message_consumed.disconnect(on_consumed)
    assert len(queries) == 0
    assert heard == [
        ("layer", copy_layer),
        ("consumed", ("duplicate", "fast path: already processed", "payment.succeeded")),
    ]
    assert orders == [order.pk]


@pytest.mark.django_db(transaction=True)
def test_an_invalid_copy_of_a_remembered_id_is_a_duplicate_by_its_id(
    make_order, redis_server, heard, copy_layer
) -> None:
    order = make_order()
    bad = {**payment(order), "type": "payment.unheard-of"}
    assert consume_message(bad, consumer="payments") is Outcome.REJECTED
    assert dedup.flush()
    assert dedup.redis.contains("payments", bad["message_id"])  # remembered: Bloom and Redis
    reach(copy_layer)
    heard.clear()
    # The id was handled: its copy is answered by the fast path, whatever the rest says.
    with CaptureQueriesContext(connection) as queries:
        assert consume_message(bad, consumer="payments") is Outcome.DUPLICATE
    assert len(queries) == 0
    assert heard == [
        ("layer", copy_layer),
        ("consumed", ("duplicate", "fast path: already processed", "payment.unheard-of")),
    ]
    assert ProcessedMessage.objects.get(message_id=bad["message_id"]).outcome == "rejected"
    # An invalid message Redis does not know is rejected, its answer not announced.
    other = {**bad, "message_id": "never-seen"}
    heard.clear()
    assert consume_message(other, consumer="payments") is Outcome.REJECTED
    assert [kind for kind, _ in heard] == ["consumed"]


def test_the_cache_is_found_once_per_thread_and_again_when_settings_change(
    redis_server,
) -> None:
    dedup.remember("payments", "m-1")
    assert dedup.flush()
    assert dedup.redis.contains("payments", "m-1")
    found = mock.patch.object(dedup.redis, "_pool", wraps=RedisLayer._pool)
    with found as pool:
        assert all(dedup.redis.contains("payments", "m-1") for _ in range(5))
        assert pool.call_count == 0
        # The same alias under another key prefix: another cache, found again.
        caches = {**settings.CACHES, "dedup": {**settings.CACHES["dedup"], "KEY_PREFIX": "other"}}
        with override_settings(CACHES=caches):
            assert not dedup.redis.contains("payments", "m-1")
            assert pool.call_count == 1
        assert dedup.redis.contains("payments", "m-1")
        assert pool.call_count == 2


def test_a_bloom_lookup_hashes_its_key_once_whatever_the_buckets() -> None:
    bloom = importlib.import_module("idempotent_orders.dedup.bloom")  # dedup.bloom: the layer
    layer = BloomLayer()
    with override_settings(
        IDEMPOTENT_ORDERS={
            **settings.IDEMPOTENT_ORDERS,
            "DEDUP_WINDOW": 24 * 3600,
            "DEDUP_BLOOM_BUCKET_SECONDS": 3600,
        }
    ):
        now = timezone.now().timestamp()
        for hours in range(24):
            layer.add("payments", f"m-{hours}", now - hours * 3600)
        assert layer.bucket_count() == 24
        with mock.patch.object(bloom, "stable_hash", wraps=bloom.stable_hash) as hashed:
            assert layer.might_contain("payments", "m-23")  # the oldest bucket
            assert not layer.might_contain("payments", "m-24")
        assert hashed.call_count == 2
        assert all(layer.might_contain("payments", f"m-{h}") for h in range(24))


@pytest.mark.django_db
def test_with_only_the_counter_listening_the_layer_is_counted_without_a_send() -> None:
    dedup.reset()
    stats.reset()
    dedup.bloom.add("payments", "maybe")
    with (
        override_settings(
            IDEMPOTENT_ORDERS={**settings.IDEMPOTENT_ORDERS, "DEDUP_CACHE_ALIAS": ""}
        ),
        mock.patch.object(dedup_answered, "send", side_effect=AssertionError("sent")),
    ):
        assert dedup.lookup("payments", "maybe") is Layer.DISABLED
        assert dedup.lookup("payments", "never") is Layer.BLOOM_NEGATIVE
    assert stats.local() == {"layer:disabled": 1, "layer:bloom-negative": 1}


def _key_function(key: str, key_prefix: str, version: int) -> str:
    return f"own|{key_prefix}|{version}|{key}"


@pytest.mark.parametrize("key_function", [None, f"{__name__}._key_function"])
def test_a_lookup_asks_for_the_key_the_cache_writes(redis_server, key_function) -> None:
    dedup_cache = {**settings.CACHES["dedup"], "VERSION": 7}
    if key_function:
        dedup_cache["KEY_FUNCTION"] = key_function
    with override_settings(CACHES={**settings.CACHES, "dedup": dedup_cache}):
        dedup.remember("payments", "m-1")
        assert dedup.flush()
        cache = dedup.redis._target().cache
        assert cache.get("processed:payments:m-1") == 1  # as the cache itself makes the key
        assert dedup.redis.contains("payments", "m-1")
        assert not dedup.redis.contains("payments", "m-2")
