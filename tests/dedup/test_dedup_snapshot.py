"""The Bloom filter's snapshot in the dedup cache: a new process starts from it and reads
only the inbox rows created since, and never answers "not seen" for a row committed
before or while it loads."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any
from unittest import mock

import pytest
from django.core.cache import caches
from django.utils import timezone

from idempotent_orders import dedup
from idempotent_orders.dedup import Layer
from idempotent_orders.dedup.bloom import BloomLayer, snapshot_key
from idempotent_orders.models import ProcessedMessage
from tests.support.overrides import settings_with
from tests.support.services import RedisServer, private_redis_settings

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    with (
        private_redis_settings(server.url),
        settings_with(DEDUP_BLOOM_WARM_UP_IN_BACKGROUND=True, DEDUP_BLOOM_SNAPSHOT=True),
    ):
        yield server
    server.stop()


def _inbox(*message_ids: str) -> None:
    ProcessedMessage.objects.bulk_create(
        ProcessedMessage(consumer="payments", message_id=m) for m in message_ids
    )


def _loaded(bloom: BloomLayer) -> BloomLayer:
    """``bloom`` after its first refresh (the background load) is done."""
    assert bloom.refresh() == 0  # started, not waited for
    assert bloom.wait_warm(30)
    return bloom


def _writer() -> BloomLayer:
    """A process whose filter is loaded and that wrote the snapshot."""
    writer = _loaded(BloomLayer())
    writer.wait_snapshot(30)  # the first complete load offers a snapshot at once
    assert caches["dedup"].get(snapshot_key()) is not None
    return writer


def test_a_new_process_starts_from_the_snapshot_and_reads_only_the_gap(
    redis_server: RedisServer,
) -> None:
    _inbox("before-1", "before-2")
    writer = _writer()
    assert writer.loaded_from == "inbox"
    _inbox("after-snapshot")  # the snapshot is stale by one row
    snapshot = caches["dedup"].get(snapshot_key())
    fresh = BloomLayer()
    reads: list[datetime] = []
    original = fresh._read

    def spy(since: datetime, generation: int | None = None, *, paced: bool = False) -> int:
        reads.append(since)
        return original(since, generation, paced=paced)

    with mock.patch.object(fresh, "_read", side_effect=spy):
        _loaded(fresh)
    assert fresh.loaded_from == "snapshot"
    assert snapshot["buckets"]
    assert all(slices == 7 for _bucket, slices in snapshot["buckets"])  # 1.7 MiB in 256 KiB
    assert reads == [min(snapshot["watermark"], snapshot["overlap_watermark"])]
    assert reads[0] > timezone.now() - timedelta(minutes=5)  # not the window (a day)
    for message_id in ("before-1", "before-2", "after-snapshot"):
        assert fresh.might_contain("payments", message_id), message_id
    assert not fresh.might_contain("payments", "never-seen")


def test_only_ids_in_the_snapshot_not_in_the_gap_come_from_it(redis_server: RedisServer) -> None:
    """An id the snapshot holds, though its row is older than the gap, is found: the filter
    came from the snapshot, not from reading the window again."""
    _inbox("anchor")
    writer = _writer()
    writer.add("payments", "only-in-snapshot")  # remembered by the writer, no inbox row
    caches["dedup"].delete(f"{snapshot_key()}:writer")
    assert writer.write_snapshot(claim=True)
    fresh = _loaded(BloomLayer())
    assert fresh.loaded_from == "snapshot"
    assert fresh.might_contain("payments", "only-in-snapshot")
    assert fresh.might_contain("payments", "anchor")


def test_rows_committed_while_the_snapshot_loads_are_never_not_seen(
    redis_server: RedisServer,
) -> None:
    _inbox("before")
    _writer()
    fresh = BloomLayer()
    original = fresh._load_snapshot
    gate = threading.Event()

    def load_then_commit_more(generation: int, *, paced: bool = False) -> datetime | None:
        since = original(generation, paced=paced)
        _inbox("committed-during-the-load")  # after the snapshot, before the gap read
        gate.wait(30)
        return since

    with (
        mock.patch.object(fresh, "_load_snapshot", side_effect=load_then_commit_more),
        mock.patch.object(dedup, "bloom", fresh),
    ):
        assert dedup.lookup("payments", "before") is Layer.BLOOM_WARMING
        assert fresh.might_contain("payments", "anything")  # loading: only "maybe"
        fresh.add("payments", "remembered-during-the-load")
        gate.set()
        assert fresh.wait_warm(30)
    assert fresh.loaded_from == "snapshot"
    for message_id in ("before", "committed-during-the-load", "remembered-during-the-load"):
        assert fresh.might_contain("payments", message_id), message_id
    assert not fresh.might_contain("payments", "never-seen")


def test_a_snapshot_older_than_the_window_is_not_used(redis_server: RedisServer) -> None:
    _inbox("in-window")
    with settings_with(DEDUP_WINDOW=3600):
        _writer()
        snapshot = caches["dedup"].get(snapshot_key())
        old = timezone.now() - timedelta(hours=2)
        snapshot.update(watermark=old, overlap_watermark=old)
        caches["dedup"].set(snapshot_key(), snapshot)
        _inbox("after")
        fresh = _loaded(BloomLayer())
    assert fresh.loaded_from == "inbox"
    assert fresh.might_contain("payments", "in-window")
    assert fresh.might_contain("payments", "after")


def test_a_snapshot_of_another_inbox_is_not_used(redis_server: RedisServer) -> None:
    """The inbox lacks the snapshot's newest row (a database restored to before it, or
    another database): the window is read, and the ids only the snapshot had are "not
    seen", so a stale Redis key for them is never asked."""
    _inbox("kept", "lost-in-the-restore")
    _writer()
    ProcessedMessage.objects.filter(message_id="lost-in-the-restore").delete()
    fresh = _loaded(BloomLayer())
    assert fresh.loaded_from == "inbox"
    assert fresh.might_contain("payments", "kept")
    assert not fresh.might_contain("payments", "lost-in-the-restore")


def test_a_snapshot_of_other_sizes_is_not_used(redis_server: RedisServer) -> None:
    _inbox("row")
    _writer()
    with settings_with(DEDUP_BLOOM_CAPACITY=2000):
        key = snapshot_key()
        assert caches["dedup"].get(key) is None  # the sizes are in the key
        fresh = _loaded(BloomLayer())
    assert fresh.loaded_from == "inbox"
    assert fresh.might_contain("payments", "row")


def test_one_process_writes_the_snapshot_per_interval(redis_server: RedisServer) -> None:
    _inbox("row")
    first = _writer()
    second = _loaded(BloomLayer())
    second.wait_snapshot(30)
    assert second.loaded_from == "snapshot"
    assert not second.write_snapshot(claim=True)  # the first wrote within the interval
    assert not first.write_snapshot(claim=True)
    assert first.write_snapshot()  # unclaimed (an operator's call) writes anyway


def test_a_loading_filter_writes_no_snapshot(redis_server: RedisServer) -> None:
    bloom = BloomLayer()
    with mock.patch.object(bloom, "_load_snapshot", return_value=None):
        assert not bloom.write_snapshot()  # never loaded
    assert caches["dedup"].get(snapshot_key()) is None


def test_without_a_snapshot_the_paced_load_reads_every_row(redis_server: RedisServer) -> None:
    ids = [f"row-{i}" for i in range(2500)]  # three paced chunks, the last one short
    _inbox(*ids)
    with settings_with(DEDUP_BLOOM_SNAPSHOT=False):
        fresh = _loaded(BloomLayer())
    assert fresh.loaded_from == "inbox"
    assert all(fresh.might_contain("payments", m) for m in ids)
    assert caches["dedup"].get(snapshot_key()) is None  # switched off: none written


def _bucket_keys() -> set[str]:
    """The keys of the snapshots' buckets (``<snapshot key>:<write>:<bucket>``)."""
    cache: Any = caches["dedup"]
    return set(cache.keys(f"{snapshot_key()}:*")) - {f"{snapshot_key()}:writer"}


def test_each_write_keeps_the_one_before_and_deletes_older_ones(redis_server: RedisServer) -> None:
    _inbox("row")
    writer = _writer()
    writes = [caches["dedup"].get(snapshot_key())["write"]]
    for _ in range(3):
        assert writer.write_snapshot()
        writes.append(caches["dedup"].get(snapshot_key())["write"])
    assert len(set(writes)) == 4
    kept = {key.split(":")[-3] for key in _bucket_keys() if key.split(":")[-3] in writes}
    assert kept == set(writes[-2:])  # the last write and the one before it


def test_a_snapshot_whose_bucket_is_gone_is_not_used(redis_server: RedisServer) -> None:
    _inbox("row")
    _writer()
    snapshot = caches["dedup"].get(snapshot_key())
    assert snapshot["buckets"]
    bucket, _slices = snapshot["buckets"][0]
    caches["dedup"].delete(f"{snapshot_key()}:{snapshot['write']}:{bucket}:0")
    fresh = _loaded(BloomLayer())
    assert fresh.loaded_from == "inbox"
    assert fresh.might_contain("payments", "row")
    assert not fresh.might_contain("payments", "never-seen")


def test_a_thread_waiting_for_the_filter_never_meets_an_unstarted_thread(
    redis_server: RedisServer,
) -> None:
    # Another thread waits (a test's cleanup, a benchmark) just as the warm-up and the
    # snapshot threads are being started: it finds the thread before, or a started one.
    bloom = BloomLayer()
    start = threading.Thread.start
    waited: list[str] = []

    def start_after_a_wait(thread: threading.Thread) -> None:
        # (The snapshot thread is started by the warm-up thread: that one waits for the
        # snapshot only.)
        if thread.name.endswith("warm-up"):
            bloom.wait_warm(0)
        else:
            bloom.wait_snapshot(0)
        waited.append(thread.name)
        start(thread)

    _inbox("row")
    with mock.patch.object(threading.Thread, "start", start_after_a_wait):
        _loaded(bloom)
        bloom.wait_snapshot(30)
    assert waited == ["idempotent-orders-bloom-warm-up", "idempotent-orders-bloom-snapshot"]
    assert caches["dedup"].get(snapshot_key()) is not None
