"""Process-local Bloom filters, one per time bucket, over processed ``(consumer, message_id)``."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.core.cache import caches
from django.db import connections, router
from django.db.models import CharField, Value
from django.db.models.functions import Concat
from django.utils import timezone
from rbloom import Bloom

from idempotent_orders.conf import conf

__all__ = ["BloomLayer", "snapshot_key", "stable_hash"]

#: Separates consumer and message id; message ids are printable, so it cannot occur in them.
_SEP = "\x1f"
#: Inbox rows fetched and added to a filter at a time by :meth:`BloomLayer.refresh`.
_CHUNK = 5000
#: The same for a window loaded from the inbox in the background: after each such chunk
#: (and each bucket of a snapshot) the loading thread sleeps ``_PAUSE`` times as long as
#: the chunk took, so the consuming thread is never kept from the interpreter for longer
#: than one small chunk, and has it three quarters of the time.
_PACED_CHUNK = 250
_PAUSE = 3.0
#: A snapshot's slice costs the Redis server too (on the same cores, often): after each,
#: a longer pause. The load still takes about a second at a day's 25 buckets.
_SNAPSHOT_PAUSE = 7.0
#: The snapshot's layout; a snapshot of another layout is not loaded.
_SNAPSHOT_FORMAT = 3
#: A snapshot's bucket is stored in slices of this many bytes: each one is read (and
#: parsed by the Redis client) in well under a millisecond, then the loader pauses.
_SLICE = 256 * 1024

logger = logging.getLogger("idempotent_orders")
#: The paced load's own clock (tests stand in for ``time`` with a clock of their own).
_perf_counter = time.perf_counter


def stable_hash(item: str) -> int:
    """A 128-bit signed hash that is the same in every process and Python run.

    rbloom's default uses Python's ``hash()``, which is salted per process
    (PYTHONHASHSEED); a filter rebuilt or compared across processes needs this.
    """
    digest = hashlib.blake2b(item.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return int.from_bytes(digest, "big", signed=True)


def _key(consumer: str, message_id: str) -> str:
    return f"{consumer}{_SEP}{message_id}"


def snapshot_key() -> str:
    """The dedup cache's key for the snapshot of the filters of the inbox's database."""
    from idempotent_orders.models import ProcessedMessage

    name = connections[router.db_for_read(ProcessedMessage)].settings_dict.get("NAME")
    sizing = f"{conf.DEDUP_BLOOM_CAPACITY}:{conf.DEDUP_BLOOM_ERROR_RATE}"
    return f"bloom-snapshot:{name}:{sizing}:{conf.DEDUP_BLOOM_BUCKET_SECONDS}"


def _slice_keys(key: str, write: str, bucket: int, slices: int) -> list[str]:
    return [f"{key}:{write}:{bucket}:{i}" for i in range(slices)]


def _written_keys(key: str, write: str, buckets: list[tuple[int, int]]) -> list[str]:
    return [k for bucket, slices in buckets for k in _slice_keys(key, write, bucket, slices)]


def _hashed(item: int) -> int:
    """The filters' hash function: their items are :func:`stable_hash` values already, so
    a lookup hashes its key once, not once per live bucket (25 with the default window)."""
    return item


class BloomLayer:
    """Time-bucketed Bloom filters covering the last ``DEDUP_WINDOW`` seconds.

    Only ever answers "certainly not seen here" or "maybe seen"; never the authority.
    A filter that was never loaded from the inbox still answers correctly in
    that sense for what this process remembered: a miss only costs a database query.

    The first :meth:`refresh` of a process loads the window (``DEDUP_WINDOW``, a
    day's messages by default) in a background thread when
    ``DEDUP_BLOOM_WARM_UP_IN_BACKGROUND`` is on; until that load is done the filter
    answers "maybe" to everything, so no message recorded by another process is
    called "not seen" while it loads: it costs a Redis lookup, as without a filter.

    With ``DEDUP_BLOOM_SNAPSHOT`` (and a dedup cache), that load starts from the
    snapshot of the filters one process writes to the cache every
    ``DEDUP_BLOOM_SNAPSHOT_INTERVAL`` seconds (:meth:`write_snapshot`): the
    buckets, how far the inbox was read into them, and the inbox's newest row
    then. A new process loads it with one GET and reads from the inbox only the
    rows created since (the gap), the way a refresh of the writer would have
    read them; until then it answers "maybe" as above. A snapshot whose newest
    row the inbox does not hold (a restored or another database), of other
    sizes, or older than the window is not used: the window is read instead, in
    small chunks with pauses so that the load leaves the interpreter to the
    consuming thread most of the time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[int, Bloom] = {}
        self._sizing: tuple[int, float] = (0, 0.0)
        #: Inbox rows created at or after this moment still need to be read.
        self._watermark: datetime | None = None
        #: The same for the read that also picks up rows committed late (once per overlap).
        self._overlap_watermark: datetime | None = None
        self._next_refresh = 0.0
        self._next_overlap_read = 0.0
        #: The live buckets at the last rotation (none is dropped until they change).
        self._live: range | None = None
        #: True from the start of a window load until it is done: answer "maybe".
        self._warming = False
        #: True while a load thread runs (set before it starts: one load at a time).
        self._loading = False
        self._warm_thread: threading.Thread | None = None
        #: Bumped by :meth:`clear`: a load begun before it leaves no trace after it.
        self._generation = 0
        #: When this process may next offer to write the snapshot (monotonic seconds).
        self._next_snapshot = 0.0
        #: The thread writing the snapshot, while one runs.
        self._snapshot_thread: threading.Thread | None = None
        #: Where the last window load started from: "snapshot", "inbox" or "" (none yet).
        self.loaded_from = ""

    # -- buckets ---------------------------------------------------------------
    def _bucket_of(self, when: float) -> int:
        return int(when // conf.DEDUP_BLOOM_BUCKET_SECONDS)

    def _live_buckets(self, now: float) -> range:
        current = self._bucket_of(now)
        span = -(-conf.DEDUP_WINDOW // conf.DEDUP_BLOOM_BUCKET_SECONDS)  # ceil
        return range(current - span, current + 1)

    def _filter(self, bucket: int) -> Bloom:
        sizing = (conf.DEDUP_BLOOM_CAPACITY, conf.DEDUP_BLOOM_ERROR_RATE)
        if sizing != self._sizing:  # settings changed: start over rather than mix sizes
            self._buckets.clear()
            self._sizing = sizing
        bloom = self._buckets.get(bucket)
        if bloom is None:
            bloom = self._buckets[bucket] = Bloom(sizing[0], sizing[1], _hashed)
        return bloom

    def _rotate(self, now: float) -> None:
        live = self._live_buckets(now)
        if live == self._live:
            return
        self._live = live
        for bucket in [b for b in self._buckets if b not in live]:
            del self._buckets[bucket]

    # -- public ----------------------------------------------------------------
    def might_contain(self, consumer: str, message_id: str) -> bool:
        hashed = stable_hash(_key(consumer, message_id))
        now = time.time()
        with self._lock:
            if self._warming:
                return True  # not loaded yet: only "maybe" is safe
            self._rotate(now)
            # Newest first (buckets are mostly made in time order): a copy usually
            # follows its original within the hour, and any() stops at the first "maybe".
            return any(hashed in bloom for bloom in reversed(self._buckets.values()))

    def might_contain_many(self, consumer: str, message_ids: Sequence[str]) -> list[bool]:
        """:meth:`might_contain` for several messages: one clock read, one rotation."""
        hashed = [stable_hash(_key(consumer, message_id)) for message_id in message_ids]
        now = time.time()
        with self._lock:
            if self._warming:
                return [True] * len(hashed)
            self._rotate(now)
            blooms = list(reversed(self._buckets.values()))
            return [any(h in bloom for bloom in blooms) for h in hashed]

    def add(self, consumer: str, message_id: str, when: float | None = None) -> None:
        hashed = stable_hash(_key(consumer, message_id))
        now = time.time()
        if when is None:  # seen now: the current bucket, live by definition
            bucket = self._bucket_of(now)
            with self._lock:
                self._filter(bucket).add(hashed)
            return
        bucket = self._bucket_of(when)
        with self._lock:
            if bucket in self._live_buckets(now):
                self._filter(bucket).add(hashed)

    def add_many(self, consumer: str, message_ids: Sequence[str]) -> None:
        """:meth:`add` for several messages seen now."""
        hashed = [stable_hash(_key(consumer, message_id)) for message_id in message_ids]
        now = time.time()
        with self._lock:
            self._filter(self._bucket_of(now)).update(hashed)

    def clear(self) -> None:
        with self._lock:
            self._generation += 1
            self._warming = False
            self._loading = False
            self._warm_thread = None
            self._buckets.clear()
            self._live = None
            self._watermark = None
            self._overlap_watermark = None
            self._next_refresh = 0.0
            self._next_overlap_read = 0.0
            self._next_snapshot = 0.0
            self.loaded_from = ""

    def rebuild(self) -> int:
        """Load the last ``DEDUP_WINDOW`` seconds of the inbox; returns the rows read."""
        self.clear()
        return self.refresh(force=True)

    def refresh(self, *, force: bool = False) -> int:
        """Read inbox rows created since the last read (at most every DEDUP_BLOOM_REFRESH s).

        Other processes' messages reach this filter only this way. Rows commit
        after their ``created_at``, so a read cannot start exactly where the
        last one stopped. Each read goes back one refresh interval before the
        previous read began; once per ``DEDUP_BLOOM_REFRESH_OVERLAP`` seconds a
        read goes back that overlap before the previous such read began. A row
        committed at most one interval after its ``created_at`` is read by the
        first read after its commit; one committed at most the overlap after
        it, by the next overlap read at the latest. A row committed later than
        that is simply a Bloom miss, which costs a database query and nothing
        else.
        """
        mono = time.monotonic()
        if not force and self._warming:
            self.warm_up()  # nothing while a load runs; after a failed one, a new one
            return 0
        if not force and mono < self._next_refresh:
            return 0
        first = self._watermark is None or self._overlap_watermark is None
        if first and not force and conf.DEDUP_BLOOM_WARM_UP_IN_BACKGROUND:
            self.warm_up()
            return 0
        self._next_refresh = mono + conf.DEDUP_BLOOM_REFRESH
        started = timezone.now()
        if self._watermark is None or self._overlap_watermark is None:  # first read: the window
            snapshot = None if force else self._load_snapshot(self._generation)
            since = started - timedelta(seconds=conf.DEDUP_WINDOW) if snapshot is None else snapshot
            self.loaded_from = "inbox" if snapshot is None else "snapshot"
            full = True
        elif mono >= self._next_overlap_read:  # rows committed late since the last such read
            since = min(self._watermark, self._overlap_watermark)
            full = True
        else:
            since = self._watermark
            full = False
        count = self._read(since)
        self._mark_read(started, mono, full=full)
        self._offer_snapshot(mono)
        return count

    def _mark_read(self, started: datetime, mono: float, *, full: bool) -> None:
        """Rows created before ``started`` (less the margins) are in the filter."""
        margin = min(conf.DEDUP_BLOOM_REFRESH, conf.DEDUP_BLOOM_REFRESH_OVERLAP)
        self._watermark = started - timedelta(seconds=margin)
        if full:
            overlap = timedelta(seconds=conf.DEDUP_BLOOM_REFRESH_OVERLAP)
            self._overlap_watermark = started - overlap
            self._next_overlap_read = mono + conf.DEDUP_BLOOM_REFRESH_OVERLAP

    # -- loading the window in the background ------------------------------------------
    def warm_up(self) -> threading.Thread:
        """Start loading the window in a background thread (once); answer "maybe" until
        it is loaded. A load that fails is started again by the next :meth:`refresh`."""
        with self._lock:
            if self._loading and self._warm_thread is not None:
                return self._warm_thread
            self._warming = self._loading = True
            thread = threading.Thread(
                target=self._warm_up,
                args=(self._generation,),
                name="idempotent-orders-bloom-warm-up",
                daemon=True,
            )
            thread.start()
            # Published once started: wait_warm() reads it without the lock, and a
            # thread not yet started cannot be joined.
            self._warm_thread = thread
        return thread

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait for a background load; True once the filter answers from the window."""
        thread = self._warm_thread
        if thread is not None:
            thread.join(timeout)
        return not self._warming

    @property
    def warming(self) -> bool:
        return self._warming

    def _warm_up(self, generation: int) -> None:
        mono = time.monotonic()
        started = timezone.now()
        try:
            snapshot = self._load_snapshot(generation, paced=True)
            if snapshot is None:
                since = started - timedelta(seconds=conf.DEDUP_WINDOW)
                count = self._read(since, generation, paced=True)
            else:
                count = self._read(snapshot, generation)  # the gap since the snapshot
        except Exception:  # the filter keeps answering "maybe"; the next refresh retries
            logger.warning("could not load the dedup Bloom filter", exc_info=True)
            with self._lock:
                if generation == self._generation:
                    self._loading = False
            return
        finally:
            connections.close_all()  # this thread's own connections
        with self._lock:
            if generation != self._generation:
                return  # cleared meanwhile
            self._mark_read(started, mono, full=True)
            self._next_refresh = mono + conf.DEDUP_BLOOM_REFRESH
            self._warming = self._loading = False
            self.loaded_from = "inbox" if snapshot is None else "snapshot"
        logger.debug("dedup Bloom filter loaded: %d inbox rows", count)
        self._offer_snapshot(time.monotonic())

    def _read(self, since: datetime, generation: int | None = None, *, paced: bool = False) -> int:
        """Add the inbox rows created at or after ``since``; returns how many.

        One query per live bucket the range touches, so rows need no time of
        their own: the database returns just the filter's key, built in SQL.
        Rows stamped later than the current bucket (clock skew) go into it.
        """
        from idempotent_orders.models import ProcessedMessage

        seconds = conf.DEDUP_BLOOM_BUCKET_SECONDS
        live = self._live_buckets(time.time())
        first = max(live.start, self._bucket_of(since.timestamp()))
        count = 0
        for bucket in range(first, live.stop):
            # Bucket edges as offsets from ``since`` keep its time zone (or its naivety).
            lower = max(since, since + timedelta(seconds=bucket * seconds - since.timestamp()))
            rows = ProcessedMessage.objects.filter(created_at__gte=lower)
            if bucket != live.stop - 1:
                upper = since + timedelta(seconds=(bucket + 1) * seconds - since.timestamp())
                rows = rows.filter(created_at__lt=upper)
            keys = rows.annotate(
                key=Concat("consumer", Value(_SEP), "message_id", output_field=CharField())
            ).values_list("key", flat=True)
            size = _PACED_CHUNK if paced else _CHUNK
            chunk: list[str] = []
            began = _perf_counter() if paced else 0.0
            for key in keys.iterator(chunk_size=size):
                chunk.append(key)
                if len(chunk) == size:
                    count += self._add_keys(bucket, chunk, generation)
                    chunk = []
                    if paced:  # leave the interpreter to the other threads
                        time.sleep(_PAUSE * (_perf_counter() - began))
                        began = _perf_counter()
            count += self._add_keys(bucket, chunk, generation)
        return count

    def _add_keys(self, bucket: int, keys: list[str], generation: int | None = None) -> int:
        hashed = [stable_hash(key) for key in keys]  # outside the lock the lookups take
        with self._lock:
            if generation is not None and generation != self._generation:
                return len(keys)  # a load from before clear(): its keys are not wanted
            if hashed and bucket in self._live_buckets(time.time()):
                self._filter(bucket).update(hashed)
        return len(keys)

    def bucket_count(self) -> int:
        return len(self._buckets)

    # -- the snapshot in the dedup cache -------------------------------------------------
    def _load_snapshot(self, generation: int, *, paced: bool = False) -> datetime | None:
        """Merge the cache's snapshot into the filters; the moment the inbox must be read
        from to complete them, or None (no usable snapshot: read the window)."""
        if not (conf.DEDUP_BLOOM_SNAPSHOT and conf.DEDUP_CACHE_ALIAS):
            return None
        from idempotent_orders.models import ProcessedMessage

        sizing = (conf.DEDUP_BLOOM_CAPACITY, conf.DEDUP_BLOOM_ERROR_RATE)
        cache = caches[conf.DEDUP_CACHE_ALIAS]
        try:
            snapshot: Any = cache.get(snapshot_key())
        except Exception:  # the cache is advisory: read the window instead
            logger.warning("could not read the dedup Bloom snapshot", exc_info=True)
            return None
        if not isinstance(snapshot, dict) or snapshot.get("format") != _SNAPSHOT_FORMAT:
            return None
        if snapshot["sizing"] != (*sizing, conf.DEDUP_BLOOM_BUCKET_SECONDS):
            return None
        since: datetime = min(snapshot["watermark"], snapshot["overlap_watermark"])
        now = time.time()
        if since.timestamp() < now - conf.DEDUP_WINDOW:
            return None  # the gap is the whole window
        newest = snapshot["newest"]
        if newest is not None:
            found = (
                ProcessedMessage.objects.filter(pk=newest[0])
                .values_list("consumer", "message_id")
                .first()
            )
            if found != tuple(newest[1:]):
                logger.info("the dedup Bloom snapshot is not of this inbox; reading the window")
                return None
        live = self._live_buckets(now)
        key = snapshot_key()
        for bucket, slices in snapshot["buckets"]:
            if bucket not in live:
                continue
            parts: list[bytes] = []
            for slice_key in _slice_keys(key, snapshot["write"], bucket, slices):
                began = _perf_counter()
                part = cache.get(slice_key)
                if not isinstance(part, bytes):  # gone (two writes since): read the window
                    logger.info("the dedup Bloom snapshot lost a bucket; reading the window")
                    return None
                parts.append(part)
                if paced:
                    time.sleep(_SNAPSHOT_PAUSE * (_perf_counter() - began))
            began = _perf_counter()
            bloom = Bloom.load_bytes(b"".join(parts), _hashed)
            with self._lock:
                if generation != self._generation:
                    return None
                if self._sizing != sizing:
                    self._buckets.clear()
                    self._sizing = sizing
                mine = self._buckets.get(bucket)
                if mine is not None:  # what this process remembered meanwhile stays
                    bloom.update(mine)
                self._buckets[bucket] = bloom
            if paced:  # a bucket at a time, leaving the interpreter to the other threads
                time.sleep(_SNAPSHOT_PAUSE * (_perf_counter() - began))
        # Just written by another process: the next one is due an interval from now.
        self._next_snapshot = time.monotonic() + conf.DEDUP_BLOOM_SNAPSHOT_INTERVAL
        return since

    def _offer_snapshot(self, mono: float) -> None:
        """Write the snapshot in a background thread, at most once per interval (and then
        only if no process of those sharing the cache wrote one within the interval)."""
        if mono < self._next_snapshot or not (conf.DEDUP_BLOOM_SNAPSHOT and conf.DEDUP_CACHE_ALIAS):
            return
        with self._lock:
            if self._warming or (self._snapshot_thread and self._snapshot_thread.is_alive()):
                return
            self._next_snapshot = mono + conf.DEDUP_BLOOM_SNAPSHOT_INTERVAL
            thread = threading.Thread(
                target=self._snapshot_in_background,
                args=(self._generation,),
                name="idempotent-orders-bloom-snapshot",
                daemon=True,
            )
            thread.start()
            self._snapshot_thread = thread  # once started, as in warm_up()

    def _snapshot_in_background(self, generation: int) -> None:
        try:
            self.write_snapshot(claim=True, generation=generation, paced=True)
        except Exception:  # advisory: the next interval tries again
            logger.warning("could not write the dedup Bloom snapshot", exc_info=True)
        finally:
            connections.close_all()  # this thread's own connections

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Wait for a snapshot being written in the background (tests, benchmarks)."""
        thread = self._snapshot_thread
        if thread is not None:
            thread.join(timeout)

    def write_snapshot(
        self, *, claim: bool = False, generation: int | None = None, paced: bool = False
    ) -> bool:
        """Write this process's filters to the dedup cache; False when nothing was written:
        the filters are not loaded, or (``claim``) a process wrote one within the interval.
        ``paced``: after each bucket copied, a pause as long (the background writer).

        Each bucket is copied under the lock on its own, after the watermarks (a
        bucket copied later only holds more ids than those watermarks promise), and
        written under a key of its own for this write; the snapshot's own key, written
        last, names them. The buckets of the write before are kept for the processes
        still loading them, those of the one before that are deleted.
        """
        from idempotent_orders.models import ProcessedMessage

        cache = caches[conf.DEDUP_CACHE_ALIAS]
        key = snapshot_key()
        interval = conf.DEDUP_BLOOM_SNAPSHOT_INTERVAL
        if claim and not cache.add(f"{key}:writer", 1, timeout=interval):
            return False
        newest = (
            ProcessedMessage.objects.order_by("-pk")
            .values_list("pk", "consumer", "message_id")
            .first()
        )
        sizing = (conf.DEDUP_BLOOM_CAPACITY, conf.DEDUP_BLOOM_ERROR_RATE)
        with self._lock:
            if self._warming or self._watermark is None or self._overlap_watermark is None:
                return False
            if generation is not None and generation != self._generation:
                return False
            generation = self._generation
            watermark, overlap_watermark = self._watermark, self._overlap_watermark
            live = self._live_buckets(time.time())
            wanted = [bucket for bucket in self._buckets if bucket in live]
        write = uuid.uuid4().hex[:12]
        written: list[tuple[int, int]] = []  # (bucket, slices)
        for bucket in wanted:
            began = _perf_counter()
            with self._lock:
                if generation != self._generation or (self._buckets and self._sizing != sizing):
                    cache.delete_many(_written_keys(key, write, written))
                    return False  # cleared, or sized anew, meanwhile
                bloom = self._buckets.get(bucket)
                data = None if bloom is None else bloom.save_bytes()
            if data is not None:
                slices = -(-len(data) // _SLICE)
                keys = _slice_keys(key, write, bucket, slices)
                cache.set_many(
                    {k: data[i * _SLICE : (i + 1) * _SLICE] for i, k in enumerate(keys)},
                    timeout=conf.DEDUP_WINDOW,
                )
                written.append((bucket, slices))
            if paced:
                time.sleep(_PAUSE * (_perf_counter() - began))
        before: Any = cache.get(key)
        if not isinstance(before, dict) or before.get("format") != _SNAPSHOT_FORMAT:
            before = None
        snapshot = {
            "format": _SNAPSHOT_FORMAT,
            "sizing": (*sizing, conf.DEDUP_BLOOM_BUCKET_SECONDS),
            "watermark": watermark,
            "overlap_watermark": overlap_watermark,
            "newest": newest,
            "write": write,
            "buckets": written,
            # The write before stays for the processes still loading it; the one before
            # that goes now.
            "previous": None if before is None else (before["write"], before["buckets"]),
        }
        cache.set(key, snapshot, timeout=conf.DEDUP_WINDOW)
        if before is not None and before["previous"] is not None:
            cache.delete_many(_written_keys(key, *before["previous"]))
        return True
