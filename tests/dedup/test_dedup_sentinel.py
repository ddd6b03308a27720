"""The dedup fast path through Redis Sentinel (django-redis's SentinelClient): the master
found through a private sentinel, reached on the fast path's own bounded connections."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from idempotent_orders import dedup
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import Outcome, ProcessedMessage
from tests.support.messages import payment
from tests.support.services import RedisSentinel, RedisServer

pytestmark = pytest.mark.backends("postgresql")


@pytest.fixture
def sentinel() -> Iterator[RedisSentinel]:
    master = RedisServer()
    watcher = RedisSentinel(master)
    try:
        master.start()
        watcher.start()
        values = {
            **settings.IDEMPOTENT_ORDERS,
            "DEDUP_CACHE_ALIAS": "dedup",
            "DEDUP_REDIS_TIMEOUT": 0.05,
            "DEDUP_REDIS_RETRY_AFTER": 5,
        }
        caches = {**settings.CACHES, "dedup": watcher.cache()}
        with override_settings(CACHES=caches, IDEMPOTENT_ORDERS=values):
            dedup.reset()
            yield watcher
            # A snapshot the test started goes to this sentinel's master: written before
            # they stop, not retried against a stopped sentinel by the next test's wait.
            dedup.bloom.wait_snapshot(30)
            dedup.reset()
    finally:
        watcher.stop()
        master.stop()


@pytest.mark.django_db(transaction=True)
def test_the_fast_path_finds_the_master_through_the_sentinel(sentinel, make_order) -> None:
    msg = payment(make_order())
    assert consume_message(msg, consumer="payments") is Outcome.APPLIED
    assert dedup.flush()
    # Written on the master the sentinel named, without waiting for replies.
    assert sentinel.master.keys(f"*processed:payments:{msg['message_id']}")
    assert list(dedup.redis._no_reply.values()) == [True]
    with CaptureQueriesContext(connection) as queries:
        assert consume_message(msg, consumer="payments") is Outcome.DUPLICATE
    assert len(queries) == 0  # answered by Redis
    assert dedup.redis.answer_many("payments", [msg["message_id"], "never"]) == (
        {msg["message_id"]},
        set(),
    )


@pytest.mark.django_db(transaction=True)
def test_a_frozen_sentinel_master_costs_one_bounded_wait(sentinel, make_order) -> None:
    seen = payment(make_order())
    assert consume_message(seen, consumer="payments") is Outcome.APPLIED
    assert dedup.flush()
    dedup.memory.clear()  # its copy reaches a process that did not apply it
    assert sentinel.master.proc is not None
    pid = sentinel.master.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        fresh = [payment(make_order()) for _ in range(3)]
        outcomes = [consume_message(m, consumer="payments") for m in fresh]
        again = consume_message(seen, consumer="payments")
        backoffs = dedup.redis.backoffs
    finally:
        os.kill(pid, signal.SIGCONT)
    assert outcomes == [Outcome.APPLIED] * 3
    assert again is Outcome.DUPLICATE  # the database decided
    assert backoffs == 1  # the first call gave up and backed Redis off; no hang
    for m in [*fresh, seen]:
        assert ProcessedMessage.objects.filter(message_id=m["message_id"]).count() == 1
