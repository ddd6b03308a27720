"""Process-local Bloom filters, one per time bucket, over processed ``(consumer, message_id)``."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timedelta

from django.db.models import CharField, Value
from django.db.models.functions import Concat
from django.utils import timezone
from rbloom import Bloom

from idempotent_orders.conf import conf

__all__ = ["BloomLayer", "stable_hash"]

#: Separates consumer and message id; message ids are printable, so it cannot occur in them.
_SEP = "\x1f"
#: Inbox rows fetched and added to a filter at a time by :meth:`BloomLayer.refresh`.
_CHUNK = 5000


def stable_hash(item: str) -> int:
    """A 128-bit signed hash that is the same in every process and Python run.

    rbloom's default uses Python's ``hash()``, which is salted per process
    (PYTHONHASHSEED); a filter rebuilt or compared across processes needs this.
    """
    digest = hashlib.blake2b(item.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return int.from_bytes(digest, "big", signed=True)


def _key(consumer: str, message_id: str) -> str:
    return f"{consumer}{_SEP}{message_id}"


class BloomLayer:
    """Time-bucketed Bloom filters covering the last ``DEDUP_WINDOW`` seconds.

    Only ever answers "certainly not seen here" or "maybe seen"; never the authority.
    A filter that was never loaded from the inbox still answers correctly in
    that sense for what this process remembered: a miss only costs a database query.
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
            bloom = self._buckets[bucket] = Bloom(sizing[0], sizing[1], stable_hash)
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
        key = _key(consumer, message_id)
        now = time.time()
        with self._lock:
            self._rotate(now)
            return any(key in bloom for bloom in self._buckets.values())

    def add(self, consumer: str, message_id: str, when: float | None = None) -> None:
        now = time.time()
        bucket = self._bucket_of(now if when is None else when)
        with self._lock:
            if bucket in self._live_buckets(now):
                self._filter(bucket).add(_key(consumer, message_id))

    def add_many(self, consumer: str, message_ids: Sequence[str]) -> None:
        """:meth:`add` for several messages seen now."""
        now = time.time()
        with self._lock:
            bloom = self._filter(self._bucket_of(now))
            for message_id in message_ids:
                bloom.add(_key(consumer, message_id))

    def clear(self) -> None:
        with self._lock:
            self._buckets.clear()
            self._live = None
            self._watermark = None
            self._overlap_watermark = None
            self._next_refresh = 0.0
            self._next_overlap_read = 0.0

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
        if not force and mono < self._next_refresh:
            return 0
        self._next_refresh = mono + conf.DEDUP_BLOOM_REFRESH
        started = timezone.now()
        overlap = timedelta(seconds=conf.DEDUP_BLOOM_REFRESH_OVERLAP)
        if self._watermark is None or self._overlap_watermark is None:  # first read: the window
            since = started - timedelta(seconds=conf.DEDUP_WINDOW)
            full = True
        elif mono >= self._next_overlap_read:  # rows committed late since the last such read
            since = min(self._watermark, self._overlap_watermark)
            full = True
        else:
            since = self._watermark
            full = False
        count = self._read(since)
        margin = min(conf.DEDUP_BLOOM_REFRESH, conf.DEDUP_BLOOM_REFRESH_OVERLAP)
        self._watermark = started - timedelta(seconds=margin)
        if full:
            self._overlap_watermark = started - overlap
            self._next_overlap_read = mono + conf.DEDUP_BLOOM_REFRESH_OVERLAP
        return count

    def _read(self, since: datetime) -> int:
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
            chunk: list[str] = []
            for key in keys.iterator(chunk_size=_CHUNK):
                chunk.append(key)
                if len(chunk) == _CHUNK:
                    count += self._add_keys(bucket, chunk)
                    chunk = []
            count += self._add_keys(bucket, chunk)
        return count

    def _add_keys(self, bucket: int, keys: list[str]) -> int:
        with self._lock:
            if keys and bucket in self._live_buckets(time.time()):
                self._filter(bucket).update(keys)
        return len(keys)

    def bucket_count(self) -> int:
        return len(self._buckets)
