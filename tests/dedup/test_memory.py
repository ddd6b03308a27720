"""This process's memory of the messages it settled: copies answered with no Redis round
trip, and nothing kept that another process may take back."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from idempotent_orders import dedup
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.dedup import memory
from idempotent_orders.dedup.memory import MemoryLayer
from idempotent_orders.models import Outcome, ProcessedMessage
from tests.support.messages import payment
from tests.support.overrides import settings_with


@pytest.fixture
def no_redis() -> Iterator[None]:
    with settings_with(DEDUP_CACHE_ALIAS=""):
        dedup.reset()
        yield
    dedup.reset()


# -- the layer alone ------------------------------------------------------------------


def test_the_oldest_ids_give_way_beyond_the_size() -> None:
    kept = MemoryLayer()
    with settings_with(DEDUP_MEMORY=3):
        kept.add_many("payments", ["a", "b", "c"])
        kept.add_many("payments", ["a"])  # added again: now the newest
        kept.add_many("payments", ["d"])
    assert [m for m in "abcd" if kept.contains("payments", m)] == ["a", "c", "d"]
    assert not kept.contains("shipping", "a")  # per consumer
    assert len(kept) == 3


def test_an_id_stops_counting_when_its_redis_key_would_expire(monkeypatch) -> None:
    kept = MemoryLayer()
    now = [1000.0]
    # The module (the package's ``memory`` attribute is this process's layer).
    module = sys.modules["idempotent_orders.dedup.memory"]
    monkeypatch.setattr(module, "monotonic", lambda: now[0])
    with settings_with(DEDUP_WINDOW=60, DEDUP_REDIS_TTL_MARGIN=10):
        kept.add_many("payments", ["a"])
        now[0] += 69
        assert kept.contains("payments", "a")
        now[0] += 2
        assert not kept.contains("payments", "a")
        kept.add_many("payments", ["b"])  # the expired one is evicted on the next add
    assert len(kept) == 1


def test_size_zero_keeps_nothing() -> None:
    kept = MemoryLayer()
    with settings_with(DEDUP_MEMORY=0):
        kept.add_many("payments", ["a"])
    assert not kept.contains("payments", "a")


# -- on the consuming road --------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_copy_of_an_applied_message_is_answered_without_redis_or_the_database(
    make_order, no_redis, layers
) -> None:
    msg = payment(make_order())
    assert consume_message(msg, consumer="payments") is Outcome.APPLIED
    with CaptureQueriesContext(connection) as queries:
        assert consume_message(msg, consumer="payments") is Outcome.DUPLICATE
    assert len(queries) == 0
    assert layers == ["bloom-negative", "memory-hit"]
    # Switched off, the copy goes on to the database (Redis is off here too).
    memory.clear()
    with settings_with(DEDUP_CACHE_ALIAS="", DEDUP_MEMORY=0):
        assert consume_message(msg, consumer="payments") is Outcome.DUPLICATE
        assert consume_message(msg, consumer="payments") is Outcome.DUPLICATE
    assert layers[2:] == ["disabled", "database-conflict", "disabled", "database-conflict"]


@pytest.mark.django_db(transaction=True)
def test_a_parked_message_is_not_kept_another_process_may_take_it_back(
    make_order, redis_server, layers
) -> None:
    """A parked message whose release fails in another process is forgotten there (its
    Redis key deleted): its redelivery here must reach the database."""
    order = make_order()
    later = payment(order, seq=2)
    assert consume_message(later, consumer="payments") is Outcome.PARKED
    assert dedup.flush()
    assert not memory.contains("payments", later["message_id"])
    dedup.redis.discard("payments", later["message_id"])  # what the other process's forget does
    ProcessedMessage.objects.filter(message_id=later["message_id"]).update(
        status="failed", outcome="", error="release failed"
    )
    layers.clear()
    with CaptureQueriesContext(connection) as queries:
        consume_message(later, consumer="payments")
    assert layers[0] == "redis-miss"
    assert len(queries) > 0  # the database decided


@pytest.mark.django_db(transaction=True)
def test_a_duplicate_the_database_found_is_not_kept(make_order, no_redis, layers) -> None:
    """Its row may be parked, or failed, by another process: only what this process
    settled is kept."""
    msg = payment(make_order())
    assert consume_message(msg, consumer="payments") is Outcome.APPLIED
    memory.clear()  # as if another process had applied it
    assert consume_message(msg, consumer="payments") is Outcome.DUPLICATE
    assert not memory.contains("payments", msg["message_id"])
    assert layers[-1] == "database-conflict"


@pytest.mark.django_db(transaction=True)
def test_a_batch_keeps_what_it_applied_and_answers_copies_from_memory(
    make_order, no_redis, layers
) -> None:
    orders = [make_order() for _ in range(3)]
    applied = [payment(o) for o in orders[:2]]
    parked = payment(orders[2], seq=2)
    assert consume_batch([*applied, parked], consumer="payments") == [
        Outcome.APPLIED,
        Outcome.APPLIED,
        Outcome.PARKED,
    ]
    assert [memory.contains("payments", m["message_id"]) for m in (*applied, parked)] == [
        True,
        True,
        False,
    ]
    layers.clear()
    assert consume_batch([*applied, parked], consumer="payments") == [Outcome.DUPLICATE] * 3
    assert sorted(layers) == ["disabled", "memory-hit", "memory-hit"]
