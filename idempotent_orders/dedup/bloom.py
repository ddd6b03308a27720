"""Process-local Bloom filters, one per time bucket, over processed ``(consumer, message_id)``."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timedelta

from django.utils import timezone
from rbloom import Bloom

from idempotent_orders.conf import conf

__all__ = ["BloomLayer", "stable_hash"]

#: Separates consumer and message id; message ids are printable, so it cannot occur in them.
_SEP = "\x1f"


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
        self._next_refresh = 0.0

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
        when = time.time() if when is None else when
        with self._lock:
            if self._bucket_of(when) in self._live_buckets(time.time()):
                self._filter(self._bucket_of(when)).add(_key(consumer, message_id))

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
            self._watermark = None
            self._next_refresh = 0.0

    def rebuild(self) -> int:
        """Load the last ``DEDUP_WINDOW`` seconds of the inbox; returns the rows read."""
        self.clear()
        return self.refresh(force=True)

    def refresh(self, *, force: bool = False) -> int:
        """Read inbox rows created since the last read (at most every DEDUP_BLOOM_REFRESH s).

        Other processes' messages reach this filter only this way. Rows commit
        after their ``created_at``, so each read overlaps the previous one by
        ``DEDUP_BLOOM_REFRESH_OVERLAP`` seconds; a row committed later than that
        is simply a Bloom miss, which costs a database query and nothing else.
        """
        from idempotent_orders.models import ProcessedMessage

        mono = time.monotonic()
        if not force and mono < self._next_refresh:
            return 0
        self._next_refresh = mono + conf.DEDUP_BLOOM_REFRESH
        started = timezone.now()
        since = self._watermark or started - timedelta(seconds=conf.DEDUP_WINDOW)
        rows = ProcessedMessage.objects.filter(created_at__gte=since).values_list(
            "consumer", "message_id", "created_at"
        )
        count = 0
        for consumer, message_id, created_at in rows.iterator(chunk_size=5000):
            self.add(consumer, message_id, created_at.timestamp())
            count += 1
        self._watermark = started - timedelta(seconds=conf.DEDUP_BLOOM_REFRESH_OVERLAP)
        return count

    def bucket_count(self) -> int:
        return len(self._buckets)
