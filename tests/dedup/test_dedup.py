"""The dedup fast path (Bloom, Redis), counters, checks and overdue parked messages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any
from unittest import mock

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from idempotent_orders import dedup, stats
from idempotent_orders.checks import check_dedup, check_redis_layer, check_setting_values
from idempotent_orders.consuming.single import consume_message, surface_overdue_parked
from idempotent_orders.dedup import Layer
from idempotent_orders.dedup.bloom import BloomLayer, stable_hash
from idempotent_orders.dedup.redis import RedisUnavailable
from idempotent_orders.models import OrderStatus, Outcome, ParkedMessage, ProcessedMessage
from idempotent_orders.signals import parked_overdue
from tests.support.messages import payment, shipment
from tests.support.overrides import settings_with
from tests.support.services import ROOT, RedisServer, private_redis_settings

S = OrderStatus


# -- Bloom layer -------------------------------------------------------------------


def test_stable_hash_is_the_same_in_another_process() -> None:
    code = "from idempotent_orders.dedup.bloom import stable_hash; print(stable_hash('pay:m-1'))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert int(out) == stable_hash("pay:m-1")
    assert -(2**127) <= stable_hash("x") < 2**127


def test_bloom_rotates_buckets_out_of_the_window() -> None:
    bloom = BloomLayer()
    with settings_with(DEDUP_WINDOW=7200, DEDUP_BLOOM_BUCKET_SECONDS=3600):
        now = timezone.now().timestamp()
        bloom.add("payments", "old", now - 4 * 3600)  # outside: never stored
        bloom.add("payments", "edge", now - 2 * 3600)
        bloom.add("payments", "new", now)
        assert not bloom.might_contain("payments", "old")
        assert bloom.might_contain("payments", "edge")
        assert bloom.might_contain("payments", "new")
        assert not bloom.might_contain("shipping", "new")
        assert bloom.bucket_count() == 2
    # Three hours later, with a one-minute window, every bucket has left it.
    later = now + 3 * 3600
    with (
        settings_with(DEDUP_WINDOW=60, DEDUP_BLOOM_BUCKET_SECONDS=3600),
        mock.patch("time.time", return_value=later),
    ):
        assert not bloom.might_contain("payments", "new")
        assert bloom.bucket_count() == 0


def test_bloom_is_sized_from_settings() -> None:
    bloom = BloomLayer()
    with settings_with(DEDUP_BLOOM_CAPACITY=1000, DEDUP_BLOOM_ERROR_RATE=0.01):
        bloom.add("c", "m")
        small = next(iter(bloom._buckets.values())).size_in_bits
    with settings_with(DEDUP_BLOOM_CAPACITY=100_000, DEDUP_BLOOM_ERROR_RATE=0.01):
        bloom.add("c", "m")  # new sizing: filters start over
        big = next(iter(bloom._buckets.values())).size_in_bits
        assert bloom.might_contain("c", "m")
    assert big > 50 * small


@pytest.mark.django_db
def test_bloom_rebuilds_from_the_inbox_window(make_order) -> None:
    order = make_order()
    consume_message(payment(order, message_id="recent"), consumer="payments")
    ProcessedMessage.objects.create(consumer="payments", message_id="ancient")
    ProcessedMessage.objects.filter(message_id="ancient").update(
        created_at=timezone.now() - timedelta(days=3)
    )
    bloom = BloomLayer()
    with settings_with(DEDUP_WINDOW=24 * 3600):
        assert bloom.rebuild() == 1
    assert bloom.might_contain("payments", "recent")
    assert not bloom.might_contain("payments", "ancient")


# -- loading the window at process start, in the background ------------------------


def _blocked_load(bloom: BloomLayer, gate: threading.Event, readers: list[Any]) -> Any:
    """A stand-in for the inbox read: waits for ``gate``, then finds one row, "seen"."""

    def read(since: datetime, generation: int | None = None, *, paced: bool = False) -> int:
        readers.append(threading.current_thread())
        gate.wait(30)
        bucket = bloom._bucket_of(time.time())
        return bloom._add_keys(bucket, ["payments\x1fseen"], generation)

    return mock.patch.object(bloom, "_read", side_effect=read)


def test_process_start_does_not_wait_for_the_window_and_answers_maybe_meanwhile() -> None:
    bloom = BloomLayer()
    gate = threading.Event()
    readers: list[Any] = []
    with (
        settings_with(DEDUP_BLOOM_WARM_UP_IN_BACKGROUND=True, DEDUP_CACHE_ALIAS=""),
        _blocked_load(bloom, gate, readers),
        mock.patch.object(dedup, "bloom", bloom),
    ):
        # The first lookup starts the load and answers before it is done: had it
        # waited, the gate (set only below) would have held it until the timeout.
        # Neither "not seen" nor a Redis answer: the database decides while it loads.
        assert dedup.lookup("payments", "seen") is Layer.BLOOM_WARMING
        assert not gate.is_set()
        assert bloom.warming
        assert bloom.might_contain("payments", "seen")
        assert bloom.might_contain("payments", "anything")  # loading: nothing is "not seen"
        assert dedup.lookup("payments", "anything") is Layer.BLOOM_WARMING
        assert dedup.lookup_many("payments", ["a", "b"]) == dict.fromkeys("ab", Layer.BLOOM_WARMING)
        bloom.add("payments", "mine")  # remembered while loading
        bloom.refresh()  # a second refresh starts no second load
        gate.set()
        assert bloom.wait_warm(30)
        assert len(readers) == 1
        assert readers[0] is not threading.main_thread()
        assert not bloom.warming
        assert bloom.might_contain("payments", "seen")
        assert bloom.might_contain("payments", "mine")
        assert not bloom.might_contain("payments", "never-seen")
        assert dedup.lookup("payments", "never-seen") is Layer.BLOOM_NEGATIVE


@pytest.mark.django_db(transaction=True)
def test_a_stale_redis_key_never_drops_a_message_while_the_filter_loads(make_order) -> None:
    """Redis holds ``processed:`` for an id the inbox lacks (the database was restored or
    failed over, Redis was not): a new process, its filter loading, applies the message."""
    order = make_order()
    message = payment(order)
    dedup.remember("payments", message["message_id"])
    dedup.flush()
    assert dedup.redis.contains("payments", message["message_id"])  # the stale key
    bloom = BloomLayer()
    gate = threading.Event()
    with (
        settings_with(DEDUP_BLOOM_WARM_UP_IN_BACKGROUND=True),
        _blocked_load(bloom, gate, []),
        mock.patch.object(dedup, "bloom", bloom),
    ):
        try:
            assert consume_message(message, consumer="payments") is Outcome.APPLIED
            assert bloom.warming  # it was answered while the filter loaded
        finally:
            gate.set()
            bloom.wait_warm(30)
    order.refresh_from_db()
    assert order.status == OrderStatus.PAID


def test_a_failed_load_keeps_answering_maybe_and_the_next_refresh_loads_again() -> None:
    from django.db import OperationalError

    bloom = BloomLayer()
    with (
        settings_with(DEDUP_BLOOM_WARM_UP_IN_BACKGROUND=True),
        mock.patch.object(bloom, "_read", side_effect=OperationalError("gone")),
    ):
        thread = bloom.warm_up()
        thread.join(30)
        assert not thread.is_alive()
        assert bloom.warming
        assert bloom.might_contain("payments", "anything")
    gate = threading.Event()
    gate.set()
    with settings_with(DEDUP_BLOOM_WARM_UP_IN_BACKGROUND=True), _blocked_load(bloom, gate, []):
        bloom.refresh()
        assert bloom.wait_warm(30)
    assert not bloom.might_contain("payments", "anything")
    assert bloom.might_contain("payments", "seen")


def test_a_load_begun_before_clear_leaves_nothing_behind() -> None:
    bloom = BloomLayer()
    gate = threading.Event()
    with settings_with(DEDUP_BLOOM_WARM_UP_IN_BACKGROUND=True), _blocked_load(bloom, gate, []):
        thread = bloom.warm_up()
        bloom.clear()
        gate.set()
        thread.join(30)
    assert not bloom.warming
    assert not bloom.might_contain("payments", "seen")  # its key was not kept
    assert bloom._watermark is None  # the next refresh loads the window again


@pytest.mark.django_db(transaction=True)
def test_the_background_load_reads_the_inbox_window() -> None:
    ProcessedMessage.objects.create(consumer="payments", message_id="in-window")
    bloom = BloomLayer()
    with settings_with(DEDUP_BLOOM_WARM_UP_IN_BACKGROUND=True, DEDUP_WINDOW=3600):
        assert bloom.refresh() == 0  # started, not waited for
        assert bloom.wait_warm(30)
        assert bloom.might_contain("payments", "in-window")
        assert not bloom.might_contain("payments", "elsewhere")


class _Clock:
    """Stands in for the ``time`` and ``timezone`` modules inside the Bloom layer."""

    def __init__(self, start: datetime) -> None:
        self.at = start

    def now(self) -> datetime:
        return self.at

    def time(self) -> float:
        return self.at.timestamp()

    def monotonic(self) -> float:
        return self.at.timestamp()


@pytest.fixture
def clock() -> Iterator[_Clock]:
    clock = _Clock(timezone.now())
    with (
        mock.patch("idempotent_orders.dedup.bloom.time", clock),
        mock.patch("idempotent_orders.dedup.bloom.timezone", clock),
    ):
        yield clock


def _committed_late(message_id: str, created_at: datetime) -> None:
    """An inbox row whose transaction commits after its ``created_at``."""
    ProcessedMessage.objects.create(
        consumer="payments", message_id=message_id, created_at=created_at
    )


@pytest.mark.django_db
def test_bloom_refresh_reads_the_overlap_once_per_overlap_period(clock) -> None:
    bloom = BloomLayer()
    with settings_with(DEDUP_BLOOM_REFRESH=5, DEDUP_BLOOM_REFRESH_OVERLAP=30):
        bloom.rebuild()
        read_at = clock.at
        # Committed now, 8 s after its created_at: later than one refresh interval.
        _committed_late("late", read_at - timedelta(seconds=8))
        _committed_late("prompt", read_at - timedelta(seconds=2))
        clock.at = read_at + timedelta(seconds=5)
        assert bloom.refresh() == 1  # only the last interval and a margin of one more
        assert bloom.might_contain("payments", "prompt")
        assert not bloom.might_contain("payments", "late")
        for _ in range(4):
            clock.at += timedelta(seconds=5)
            assert bloom.refresh() == 0
        assert not bloom.might_contain("payments", "late")
        clock.at = read_at + timedelta(seconds=30)
        # The overlap read goes back the overlap before the previous one began,
        # not before its own start (which would be 22 s after "late").
        assert bloom.refresh() == 2
        assert bloom.might_contain("payments", "late")
        clock.at += timedelta(seconds=5)
        assert bloom.refresh() == 0


@pytest.mark.django_db
def test_bloom_refresh_loses_no_row_committed_within_the_overlap(clock) -> None:
    bloom = BloomLayer()
    clock.at -= timedelta(seconds=240)
    expected: list[str] = []
    with settings_with(DEDUP_BLOOM_REFRESH=5, DEDUP_BLOOM_REFRESH_OVERLAP=30):
        bloom.rebuild()
        for step in range(40):
            # Irregular gaps between refreshes, as lookups come.
            clock.at += timedelta(seconds=(5, 11, 6, 17)[step % 4])
            for delay in (0, 1, 4, 5, 6, 10, 17, 29, 30):
                message_id = f"s{step}-d{delay}"
                _committed_late(message_id, clock.at - timedelta(seconds=delay))
                expected.append(message_id)
            bloom.refresh()
            clock.at += timedelta(seconds=1)
            bloom.refresh()  # too soon: reads nothing
        for _ in range(8):  # one more overlap period without new rows
            clock.at += timedelta(seconds=5)
            bloom.refresh()
    missing = [m for m in expected if not bloom.might_contain("payments", m)]
    assert missing == []


@pytest.mark.django_db
def test_bloom_refresh_puts_rows_into_their_buckets(clock) -> None:
    bloom = BloomLayer()
    now = clock.at
    with settings_with(DEDUP_WINDOW=60, DEDUP_BLOOM_BUCKET_SECONDS=10):
        _committed_late("gone", now - timedelta(seconds=90))
        _committed_late("older", now - timedelta(seconds=25))
        _committed_late("recent", now - timedelta(seconds=12))
        _committed_late("now", now)
        _committed_late("ahead", now + timedelta(seconds=3600))  # a skewed clock
        assert bloom.rebuild() == 4
        assert not bloom.might_contain("payments", "gone")
        for message_id in ("older", "recent", "now", "ahead"):
            assert bloom.might_contain("payments", message_id)
        assert bloom.bucket_count() == 3
        # 50 s later the bucket of "older" has left the window; the current one has not.
        clock.at = now + timedelta(seconds=50)
        assert not bloom.might_contain("payments", "older")
        assert bloom.might_contain("payments", "ahead")


@pytest.mark.django_db
def test_bloom_refresh_adds_rows_in_chunks_without_losing_any(clock) -> None:
    for i in range(7):
        _committed_late(f"m-{i}", clock.at - timedelta(seconds=i))
    bloom = BloomLayer()
    with mock.patch("idempotent_orders.dedup.bloom._CHUNK", 3):
        assert bloom.rebuild() == 7
    assert all(bloom.might_contain("payments", f"m-{i}") for i in range(7))


@pytest.mark.django_db
def test_a_bloom_positive_alone_never_drops_a_message(make_order, layers) -> None:
    order = make_order()
    msg = payment(order)
    dedup.bloom.add("payments", msg["message_id"])  # e.g. a false positive
    with settings_with(DEDUP_CACHE_ALIAS=""):
        assert consume_message(msg, consumer="payments") is Outcome.APPLIED
    assert layers[0] == "disabled"


# -- Redis layer (private server) ----------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_redis_hit_answers_without_the_database(make_order, redis_server, layers) -> None:
    order = make_order()
    msg = payment(order)
    assert consume_message(msg, consumer="payments") is Outcome.APPLIED
    assert dedup.flush()  # written by the background thread
    assert redis_server.keys("*processed:payments:*")
    dedup.memory.clear()  # the copy reaches a process that did not apply the message
    with CaptureQueriesContext(connection) as queries:
        assert consume_message(msg, consumer="payments") is Outcome.DUPLICATE
    assert len(queries) == 0
    assert layers == ["bloom-negative", "redis-hit"]
    ttl = redis_server.ttl(redis_server.keys("*processed:payments:*")[0])
    assert 600 < ttl <= 660  # DEDUP_WINDOW + DEDUP_REDIS_TTL_MARGIN in tests/settings


def test_fast_path_keys_are_sent_without_waiting_and_replies_stay_in_step(redis_server) -> None:
    from django.core.cache import caches

    dedup.reset()
    for n in range(50):
        dedup.remember("payments", f"m-{n}")
    assert dedup.flush()
    assert list(dedup.redis._no_reply.values()) == [True]  # CLIENT REPLY SKIP was taken
    cache = caches["dedup"]
    cache.set("other", "value")  # a reply left unread on the pool would answer this get
    assert cache.get("other") == "value"
    assert all(dedup.redis.contains("payments", f"m-{n}") for n in range(50))
    assert not dedup.redis.contains("payments", "never")
    assert 600 < redis_server.ttl(redis_server.keys("*processed:payments:m-7")[0]) <= 660


def test_fast_path_keys_and_lookups_use_the_threads_own_connection(redis_server) -> None:
    from redis import ConnectionPool

    dedup.reset()
    dedup.remember("payments", "warm")  # probes CLIENT REPLY SKIP through the pool once
    assert dedup.flush()
    with mock.patch.object(
        ConnectionPool, "get_connection", side_effect=AssertionError("pool checkout")
    ):
        for n in range(20):
            dedup.remember("payments", f"own-{n}")
        assert all(dedup.redis.contains("payments", f"own-{n}") for n in range(20))
        assert not dedup.redis.contains("payments", "never")
    assert redis_server.keys("*processed:payments:own-19")


def test_a_redis_restart_costs_the_fast_path_at_most_one_key(redis_server) -> None:
    dedup.reset()
    dedup.remember("payments", "before")
    assert dedup.redis.contains("payments", "before")
    redis_server.stop()
    redis_server.start()  # same port, empty: the thread's connection is dead
    for n in range(3):
        dedup.remember("payments", f"after-{n}")
    # The batch's PING finds the connection closed: the batch goes out again on a
    # new connection, without marking Redis down.
    assert all(dedup.redis.contains("payments", f"after-{n}") for n in range(3))
    assert dedup.redis._down_until == 0.0
    assert not dedup.redis.contains("payments", "before")


def test_fast_path_keys_are_written_by_a_background_thread(redis_server) -> None:
    dedup.reset()
    dedup.remember("payments", "warm")
    assert dedup.flush()
    # A batch being written holds the writer's lock: remember() does not wait for it.
    with dedup.redis._writing:
        dedup.remember("payments", "queued")
        assert not redis_server.keys("*processed:payments:queued")
        assert not dedup.flush(timeout=0.01)  # the batch in progress is not done
    assert dedup.flush()
    assert redis_server.keys("*processed:payments:queued")
    writer = dedup.redis._writer
    assert writer is not None
    assert writer.is_alive()
    assert writer is not threading.current_thread()


def test_a_lookup_here_sees_a_key_still_queued(redis_server, monkeypatch) -> None:
    dedup.reset()
    dedup.remember("payments", "warm")
    assert dedup.flush()
    monkeypatch.setattr(dedup.redis, "linger", 0.5)  # the writer waits before it writes
    dedup.remember("payments", "just-done")
    # The lookup writes what this process queued before it asks.
    assert dedup.redis.contains("payments", "just-done")
    assert dedup.redis.contains_many("payments", ["just-done", "never"]) == {"just-done"}


def test_reset_drops_the_queued_keys(redis_server, monkeypatch) -> None:
    dedup.reset()
    dedup.remember("payments", "warm")
    assert dedup.flush()
    monkeypatch.setattr(dedup.redis, "linger", 5.0)
    # A writer cycle woken by "warm" may still be lingering the old few milliseconds;
    # let it end, so the next cycle lingers the new five seconds.
    time.sleep(0.3)
    dedup.remember("payments", "dropped")
    dedup.reset()
    assert dedup.flush()
    assert not redis_server.keys("*processed:payments:dropped")


def test_the_key_writer_outlives_a_redis_outage(redis_server) -> None:
    dedup.reset()
    dedup.remember("payments", "before")
    assert dedup.flush()
    redis_server.stop()
    dedup.remember("payments", "lost")
    assert dedup.flush()  # the write failed: logged, Redis skipped for a while
    assert dedup.redis._down_until > 0
    redis_server.start()
    dedup.redis._down_until = 0.0  # the back-off is over
    dedup.remember("payments", "after")
    assert dedup.flush()
    assert redis_server.keys("*processed:payments:after")
    writer = dedup.redis._writer
    assert writer is not None
    assert writer.is_alive()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_with_no_queue_and_no_writer(redis_server) -> None:
    dedup.reset()
    dedup.remember("payments", "parent")
    with dedup.redis._writing, dedup.redis._lock:  # held by the parent at the fork
        pid = os.fork()
        if pid == 0:  # the child: its own locks, queue and (not yet) writer
            fresh = (
                dedup.redis._queued == []
                and dedup.redis._writer is None
                and dedup.redis._writing.acquire(timeout=1)
                and dedup.redis._lock.acquire(timeout=1)
            )
            os._exit(0 if fresh else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_batch_of_keys_goes_in_one_send_and_replies_stay_in_step(redis_server) -> None:
    from django.core.cache import caches

    dedup.reset()
    ids = [f"b-{n}" for n in range(200)]
    dedup.remember_many("payments", ids)
    cache = caches["dedup"]
    cache.set("other", "value")
    assert cache.get("other") == "value"
    assert all(dedup.redis.contains("payments", m) for m in ids)
    assert all(dedup.bloom.might_contain("payments", m) for m in ids)
    assert 600 < redis_server.ttl(redis_server.keys("*processed:payments:b-199")[0]) <= 660


def test_a_server_refusing_client_reply_gets_a_plain_set() -> None:
    from django.core.cache import caches

    server = RedisServer("--rename-command", "CLIENT", "")
    server.start()
    try:
        with private_redis_settings(server.url):
            dedup.reset()
            dedup.remember("payments", "m-1")
            dedup.remember_many("payments", ["m-2", "m-4"])
            assert dedup.flush()
            assert list(dedup.redis._no_reply.values()) == [False]
            assert dedup.redis.contains("payments", "m-4")
            cache = caches["dedup"]
            cache.set("other", "value")
            assert cache.get("other") == "value"
            assert dedup.redis.contains("payments", "m-1")
            assert dedup.redis.contains("payments", "m-2")
            assert not dedup.redis.contains("payments", "m-3")
    finally:
        server.stop()
        dedup.reset()


@pytest.mark.django_db(transaction=True)
def test_redis_flushed_or_down_falls_back_to_the_database(make_order, redis_server, layers) -> None:
    order = make_order()
    msg = payment(order)
    assert consume_message(msg, consumer="payments") is Outcome.APPLIED
    assert dedup.flush()
    redis_server.flushall()
    dedup.memory.clear()  # the copy reaches a process that did not apply the message
    assert consume_message(msg, consumer="payments") is Outcome.DUPLICATE
    assert layers[-2:] == ["redis-miss", "database-conflict"]
    redis_server.stop()
    assert consume_message(msg, consumer="payments") is Outcome.DUPLICATE
    assert consume_message(shipment(order), consumer="shipping") is Outcome.APPLIED
    assert "redis-down" in layers
    assert layers[-1] == "bloom-negative"
    assert ProcessedMessage.objects.filter(message_id=msg["message_id"]).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_frozen_redis_costs_each_call_one_bounded_wait(make_order, redis_server, layers) -> None:
    """A Redis that stopped answering (SIGSTOP: connections accepted, nothing read) is
    one ``DEDUP_REDIS_TIMEOUT`` per call; the database decides, each message applies once."""
    assert redis_server.proc is not None
    pid = redis_server.proc.pid
    with settings_with(DEDUP_REDIS_TIMEOUT=0.05, DEDUP_REDIS_RETRY_AFTER=1):
        dedup.reset()
        seen = payment(make_order())
        assert consume_message(seen, consumer="payments") is Outcome.APPLIED
        assert dedup.flush()
        dedup.memory.clear()  # its copy reaches a process that did not apply it
        orders = [make_order() for _ in range(5)]
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            msgs = [payment(o) for o in orders]
            outcomes = [consume_message(m, consumer="payments") for m in msgs]
            again = consume_message(seen, consumer="payments")
            # Each kind of call, each past the back-off, gives up on its own.
            for n in range(3):
                dedup.redis._down_until = 0.0
                with pytest.raises(RedisUnavailable):
                    dedup.redis.contains("payments", f"frozen-{n}")
                dedup.redis._down_until = 0.0
                with pytest.raises(RedisUnavailable):
                    dedup.redis.contains_many("payments", [f"frozen-{n}", "other"])
                dedup.redis._down_until = 0.0
                dedup.remember("payments", f"frozen-{n}")
                assert dedup.flush(timeout=5)  # the writer's batch gave up too
                assert dedup.redis._down_until > time.monotonic()
            elapsed = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        assert outcomes == [Outcome.APPLIED] * 5
        assert again is Outcome.DUPLICATE
        assert "redis-down" in layers
        assert elapsed < 2.0  # ~13 bounded waits; an unbounded one would hang here
        ids = [m["message_id"] for m in msgs] + [seen["message_id"]]
        for message_id in ids:
            assert ProcessedMessage.objects.filter(message_id=message_id).count() == 1
        # Once the back-off is over, Redis answers again.
        time.sleep(1.1)
        fresh = payment(make_order())
        assert consume_message(fresh, consumer="payments") is Outcome.APPLIED
        assert dedup.flush()
        dedup.memory.clear()
        assert consume_message(fresh, consumer="payments") is Outcome.DUPLICATE
        assert layers[-1] == "redis-hit"
        assert redis_server.keys(f"*processed:payments:{fresh['message_id']}")


@pytest.mark.django_db
def test_nothing_is_remembered_before_commit(
    make_order, django_capture_on_commit_callbacks
) -> None:
    order = make_order()
    msg = payment(order)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        assert consume_message(msg, consumer="payments") is Outcome.APPLIED
    assert not dedup.bloom.might_contain("payments", msg["message_id"])
    for callback in callbacks:
        callback()
    assert dedup.bloom.might_contain("payments", msg["message_id"])


# -- counters ----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_stats_command_counts_outcomes_and_layers(make_order, redis_server, capsys) -> None:
    stats.reset(shared=True)
    order = make_order()
    msg = payment(order)
    consume_message(msg, consumer="payments")
    consume_message(msg, consumer="payments")
    consume_message(shipment(order, "delivered", seq=3), consumer="shipping")
    call_command("idempotent_orders_stats", "--json")
    import json

    counts = json.loads(capsys.readouterr().out)
    assert counts["outcome:applied"] == 1
    assert counts["outcome:duplicate"] == 1
    assert counts["outcome:parked"] == 1
    assert counts["layer:bloom-negative"] == 2
    assert counts["layer:memory-hit"] == 1  # this process applied it
    call_command("idempotent_orders_stats", "--reset")
    assert stats.read() == {}


# -- sequencing details ----------------------------------------------------------------


@pytest.mark.django_db
def test_invalid_message_ahead_of_a_gap_waits_and_still_fills_its_slot(make_order) -> None:
    order = make_order()
    bad = payment(order, seq=2, amount="999.00")
    assert consume_message(bad, consumer="payments") is Outcome.PARKED
    later = shipment(order, seq=3)
    assert consume_message(later, consumer="shipping") is Outcome.PARKED
    assert consume_message(payment(order, seq=1), consumer="payments") is Outcome.APPLIED
    row = ProcessedMessage.objects.get(message_id=bad["message_id"])
    assert row.outcome == Outcome.REJECTED
    assert "amount" in row.error
    order.refresh_from_db()
    assert (order.status, order.last_seq) == (S.SHIPPED, 3)
    assert not ParkedMessage.objects.exists()


@pytest.mark.django_db
def test_overdue_parked_messages_are_surfaced_once(make_order) -> None:
    order = make_order()
    waiting = shipment(order, "delivered", seq=3)
    assert consume_message(waiting, consumer="shipping") is Outcome.PARKED
    sent: list[tuple[str, float]] = []

    def record(sender: Any, parked: ParkedMessage, waited: float, **kwargs: Any) -> None:
        sent.append((parked.message_id, waited))

    parked_overdue.connect(record)
    try:
        assert surface_overdue_parked(timeout=3600) == []
        ParkedMessage.objects.update(parked_at=timezone.now() - timedelta(hours=2))
        call_command("surface_parked", "--timeout", "3600")
        assert surface_overdue_parked(timeout=3600) == []  # once only
    finally:
        parked_overdue.disconnect(record)
    assert [m for m, _ in sent] == [waiting["message_id"]]
    assert sent[0][1] >= 7200
    assert ParkedMessage.objects.get().overdue_at is not None


@pytest.mark.django_db
def test_overdue_pass_releases_a_gap_filled_by_a_worker_that_died_at_once(make_order) -> None:
    from idempotent_orders.consuming import single

    order = make_order()
    early = shipment(order, seq=2)
    assert consume_message(early, consumer="shipping") is Outcome.PARKED
    # The predecessor commits in a worker that dies before it releases its successors.
    with mock.patch.object(single, "release_parked", return_value=[]):
        assert consume_message(payment(order, seq=1), consumer="payments") is Outcome.APPLIED
    assert ParkedMessage.objects.filter(message_id=early["message_id"]).exists()
    # The next pass releases it, long before PARKED_TIMEOUT: its seq can go ahead now.
    assert surface_overdue_parked(timeout=3600) == []
    assert not ParkedMessage.objects.exists()
    order.refresh_from_db()
    assert (order.status, order.last_seq) == (S.SHIPPED, 2)
    row = ProcessedMessage.objects.get(message_id=early["message_id"])
    assert row.outcome == Outcome.APPLIED


@pytest.mark.django_db
def test_overdue_pass_tries_a_state_parked_message_again_after_the_attention_delay(
    make_order,
) -> None:
    from idempotent_orders.conf import conf
    from idempotent_orders.consuming import single

    order = make_order()
    early = shipment(order, "delivered")  # no seq: it waits for the order to be shipped
    assert consume_message(early, consumer="shipping") is Outcome.PARKED
    with mock.patch.object(single, "release_parked", return_value=[]):
        consume_message(payment(order), consumer="payments")
        consume_message(shipment(order), consumer="shipping")
    order.refresh_from_db()
    assert order.status == S.SHIPPED
    # Without a seq the pass cannot tell it may go ahead: it waits PARKED_ATTENTION_AFTER.
    assert surface_overdue_parked(timeout=3600) == []
    assert ParkedMessage.objects.filter(message_id=early["message_id"]).exists()
    waited = timedelta(seconds=conf.PARKED_ATTENTION_AFTER + 1)
    ParkedMessage.objects.update(parked_at=timezone.now() - waited)
    assert surface_overdue_parked(timeout=3600) == []
    assert not ParkedMessage.objects.exists()
    order.refresh_from_db()
    assert order.status == S.COMPLETED


# -- checks ------------------------------------------------------------------------


def test_checks_for_the_fast_path() -> None:
    assert check_dedup() == []
    with settings_with(DEDUP_CACHE_ALIAS="nope"):
        assert [e.id for e in check_dedup()] == ["idempotent_orders.E010"]
    with settings_with(DEDUP_BLOOM_CAPACITY=0, DEDUP_BLOOM_ERROR_RATE=1.5):
        assert [e.id for e in check_dedup()] == ["idempotent_orders.E012"]
        # The capacity is one of the settings the single positive rule holds.
        assert [e.id for e in check_setting_values()] == ["idempotent_orders.E036"]
    locmem = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    with override_settings(CACHES=locmem):
        assert check_redis_layer()[0].id == "idempotent_orders.E033"


# -- several messages at once (the batch consumer) ---------------------------------


@pytest.mark.django_db
def test_lookup_many_asks_redis_once_and_answers_as_lookup_does(redis_server, layers) -> None:
    dedup.reset()
    dedup.remember_many("payments", ["m-1", "m-2"])
    dedup.bloom.add("payments", "m-3")  # a Bloom "maybe" without a Redis key
    ids = ["m-1", "m-2", "m-3", "m-4"]
    with mock.patch.object(dedup.redis, "contains", side_effect=AssertionError("one GET each")):
        answered = dedup.lookup_many("payments", ids)
    expected = [Layer.REDIS_HIT, Layer.REDIS_HIT, Layer.REDIS_MISS, Layer.BLOOM_NEGATIVE]
    assert [answered[m] for m in ids] == expected
    assert [dedup.lookup("payments", m) for m in ids] == expected
    # dedup_answered went out once per message, in order, as lookup() sends it.
    assert layers == [layer.value for layer in expected] * 2


@pytest.mark.django_db
def test_lookup_many_without_redis_goes_to_the_database(redis_server) -> None:
    dedup.reset()
    dedup.remember_many("payments", ["m-1"])
    redis_server.stop()
    answered = dedup.lookup_many("payments", ["m-1", "m-2"])
    assert answered == {"m-1": Layer.REDIS_DOWN, "m-2": Layer.BLOOM_NEGATIVE}


@pytest.mark.django_db
def test_lookup_many_counts_each_answer_when_only_the_counter_listens(redis_server) -> None:
    dedup.reset()
    stats.reset()
    dedup.remember_many("payments", ["m-1"])
    with mock.patch.object(dedup, "announce", side_effect=AssertionError("sent one by one")):
        dedup.lookup_many("payments", ["m-1", "m-2", "m-3"])
    counts = stats.local()
    assert counts["layer:redis-hit"] == 1
    assert counts["layer:bloom-negative"] == 2
