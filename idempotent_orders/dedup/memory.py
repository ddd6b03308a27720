"""This process's own memory of the messages it settled for good, in front of Redis.

A copy of a message this process applied (or found stale, or rejected) is answered
from here, with no Redis round trip. Only those outcomes are kept: their inbox row
is ``done`` and nothing reopens a ``done`` row. A parked message, or a duplicate the
database found (whose row may be parked, or failed, in another process), is not
kept: another process may take it back (:func:`idempotent_orders.dedup.forget`), and
only Redis hears of that. An id is kept as long as its Redis key would be
(``DEDUP_WINDOW + DEDUP_REDIS_TTL_MARGIN``), and the oldest ids give way beyond
``DEDUP_MEMORY`` of them.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from time import monotonic

from idempotent_orders.conf import conf

__all__ = ["MemoryLayer"]


class MemoryLayer:
    """Ids (with the moment each stops counting) in the order they were added.

    Lookups take no lock: a dict read is atomic. Adding and evicting hold one.
    """

    def __init__(self) -> None:
        # Ordered: the oldest is taken from the front in constant time (a plain dict's
        # front fills with deleted slots, and finding its first key grows with them).
        self._expires: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        # The ids stay true in a child (they were committed); a lock held by another
        # thread of the parent at the fork would never be released there.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._expires)

    def contains(self, consumer: str, message_id: str) -> bool:
        """True when this process settled ``message_id`` for good within its key's lifetime."""
        expires = self._expires.get((consumer, message_id))
        return expires is not None and expires > monotonic()

    def add_many(self, consumer: str, message_ids: Iterable[str]) -> None:
        """Keep ``message_ids`` (call after their transaction committed, as for Redis)."""
        size = conf.DEDUP_MEMORY
        if size <= 0:
            return
        now = monotonic()
        expires = now + conf.DEDUP_WINDOW + conf.DEDUP_REDIS_TTL_MARGIN
        with self._lock:
            kept = self._expires
            for message_id in message_ids:
                key = (consumer, message_id)
                kept[key] = expires
                kept.move_to_end(key)  # the newest is evicted last
            while kept:
                until = next(iter(kept.values()))  # the oldest
                if len(kept) <= size and until > now:
                    break
                kept.popitem(last=False)

    def discard(self, consumer: str, message_id: str) -> None:
        with self._lock:
            self._expires.pop((consumer, message_id), None)

    def clear(self) -> None:
        with self._lock:
            self._expires = OrderedDict()
