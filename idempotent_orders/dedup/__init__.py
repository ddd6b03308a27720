"""Advisory fast path in front of the inbox's unique index: this process's memory of
what it settled, then a Bloom filter, then Redis.

``lookup()`` says which layer answered; only a layer of :data:`KNOWN` (this process's
memory, or a Redis key) lets the caller skip the database. A Bloom positive alone never
drops a message, and a Redis outage or flush only sends messages to the database,
whose unique index stays the only authority. ``remember()`` is called once a message's
work (its transaction and the release of the successors it unblocked) is done.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections import Counter
from collections.abc import Sequence

from django.db import DatabaseError, transaction

from idempotent_orders import stats
from idempotent_orders.conf import conf
from idempotent_orders.dedup.bloom import BloomLayer
from idempotent_orders.dedup.memory import MemoryLayer
from idempotent_orders.dedup.redis import RedisLayer, RedisUnavailable
from idempotent_orders.signals import dedup_answered

__all__ = [
    "KNOWN",
    "Layer",
    "announce",
    "ask",
    "bloom",
    "flush",
    "lookup",
    "lookup_many",
    "memory",
    "redis",
    "remember",
    "remember_many",
    "reset",
    "seen",
]

logger = logging.getLogger("idempotent_orders")


class Layer(enum.StrEnum):
    """Which layer answered a lookup. The values are the counter names."""

    #: The local Bloom filter has never seen the id: straight to the database.
    BLOOM_NEGATIVE = "bloom-negative"
    #: The Bloom filter is still loading (a new process): straight to the database.
    #: Redis is not asked: a key it holds for an id the inbox lacks (Redis kept, the
    #: database restored or failed over) would drop the message as a duplicate, and
    #: only a loaded filter's "maybe" (an id the inbox had) may send a lookup to Redis.
    BLOOM_WARMING = "bloom-warming"
    #: This process applied the message (or found it stale, or rejected it) itself, within
    #: its Redis key's lifetime: a duplicate, no query and no Redis round trip.
    MEMORY_HIT = "memory-hit"
    #: Bloom said "maybe" and Redis holds the ``processed:`` key: a duplicate, no query.
    REDIS_HIT = "redis-hit"
    #: Bloom said "maybe" (a false positive, or the key expired or was flushed).
    REDIS_MISS = "redis-miss"
    #: Bloom said "maybe" but Redis did not answer.
    REDIS_DOWN = "redis-down"
    #: Past this process's memory, the fast path is switched off (DEDUP_BLOOM false and
    #: no cache alias), or the Bloom filter's "maybe" has no Redis to ask.
    DISABLED = "disabled"
    #: Sent by the consumer when the inbox's unique index found the duplicate.
    DATABASE_CONFLICT = "database-conflict"


#: The answers that let the caller skip the database: the message is a duplicate.
KNOWN = frozenset({Layer.MEMORY_HIT, Layer.REDIS_HIT})

#: This process's layers. Module-level so every consumer in the process shares them.
memory = MemoryLayer()
bloom = BloomLayer()
redis = RedisLayer()


def announce(layer: Layer, consumer: str, message_id: str) -> Layer:
    """Send ``dedup_answered`` with what :func:`ask` answered (where only the built-in
    counter listens, count it without the send)."""
    if _only_counted():
        stats.incr(_COUNTER_NAMES[layer])  # what the one receiver would do, without the send
    else:
        dedup_answered.send(sender=Layer, layer=layer, consumer=consumer, message_id=message_id)
    return layer


def lookup(consumer: str, message_id: str) -> Layer:
    """Ask the fast layers about a message; sends ``dedup_answered`` with the answer."""
    return announce(ask(consumer, message_id), consumer, message_id)


def ask(consumer: str, message_id: str) -> Layer:
    """:func:`lookup` without the announcement: the caller announces the answer (:func:`announce`)
    once it knows the message is one to count (the consumer: a hit, or a valid envelope)."""
    if memory.contains(consumer, message_id):
        return Layer.MEMORY_HIT
    if conf.DEDUP_BLOOM:
        try:
            bloom.refresh()
        except DatabaseError:  # the consumer meets the same error and retries
            logger.warning("could not refresh the dedup Bloom filter", exc_info=True)
        if bloom.warming:
            return Layer.BLOOM_WARMING
        if not bloom.might_contain(consumer, message_id):
            return Layer.BLOOM_NEGATIVE
    if not redis.enabled:
        return Layer.DISABLED
    try:
        return Layer.REDIS_HIT if redis.contains(consumer, message_id) else Layer.REDIS_MISS
    except RedisUnavailable:
        return Layer.REDIS_DOWN


def lookup_many(consumer: str, message_ids: Sequence[str]) -> dict[str, Layer]:
    """:func:`lookup` for several messages: after this process's memory, the Bloom filter
    is refreshed at most once and Redis is asked once (one ``MGET``; on a cluster one per
    slot, sent to every master at once) about the ids the filter may hold.
    ``dedup_answered`` is sent for each message, as :func:`lookup` sends it.
    """
    layers: dict[str, Layer] = {}
    maybe: list[str] = []
    for message_id in message_ids:
        if memory.contains(consumer, message_id):
            layers[message_id] = Layer.MEMORY_HIT
        else:
            maybe.append(message_id)
    asked = maybe
    if conf.DEDUP_BLOOM and maybe:
        try:
            bloom.refresh()
        except DatabaseError:
            logger.warning("could not refresh the dedup Bloom filter", exc_info=True)
        maybe = []
        if bloom.warming:
            layers.update(dict.fromkeys(asked, Layer.BLOOM_WARMING))
        else:
            found = bloom.might_contain_many(consumer, asked)
            for message_id, might in zip(asked, found, strict=True):
                if might:
                    maybe.append(message_id)
                else:
                    layers[message_id] = Layer.BLOOM_NEGATIVE
    if maybe:
        if not redis.enabled:
            layers.update(dict.fromkeys(maybe, Layer.DISABLED))
        else:
            try:
                hits, unanswered = redis.answer_many(consumer, maybe)
            except RedisUnavailable:
                layers.update(dict.fromkeys(maybe, Layer.REDIS_DOWN))
            else:
                for message_id in maybe:
                    if message_id in hits:
                        layers[message_id] = Layer.REDIS_HIT
                    elif message_id in unanswered:  # its cluster master did not answer
                        layers[message_id] = Layer.REDIS_DOWN
                    else:
                        layers[message_id] = Layer.REDIS_MISS
    if _only_counted():
        # The one receiver is the built-in counter: count per layer, not per message.
        for layer, count in Counter(layers[m] for m in message_ids).items():
            stats.incr(_COUNTER_NAMES[layer], count)
    else:
        for message_id in message_ids:
            announce(layers[message_id], consumer, message_id)
    return layers


#: The ``dispatch_uid`` of the built-in receiver that counts ``dedup_answered``.
COUNTER_UID = "idempotent_orders.count_layer"


#: The counter each layer's answers are counted under (``count_layer`` in receivers.py).
_COUNTER_NAMES = {layer: f"layer:{layer}" for layer in Layer}


def _only_counted() -> bool:
    """Whether the built-in counter is the only receiver of ``dedup_answered``: then the
    lookups count their answers themselves, which is all that receiver does, and a
    receiver anyone connects gets the signal again."""
    receivers = dedup_answered.receivers
    return len(receivers) == 1 and receivers[0][0][0] == COUNTER_UID


def seen(consumer: str, message_id: str) -> bool:
    """True only when a message is known, for certain, to have been processed."""
    return lookup(consumer, message_id) in KNOWN


def remember(consumer: str, message_id: str, *, settled: bool = False) -> None:
    """Record a processed message in the fast layers (call after commit); ``settled``:
    its inbox row is done for good (``models.SETTLED_OUTCOMES``), so this process's
    memory keeps it too."""
    if settled:
        memory.add_many(consumer, (message_id,))
    if conf.DEDUP_BLOOM:
        bloom.add(consumer, message_id)
    if redis.enabled:
        # On failure the next copy goes to the database, which still answers exactly.
        with contextlib.suppress(RedisUnavailable):
            redis.add(consumer, message_id)


def remember_many(consumer: str, message_ids: list[str], *, settled: Sequence[str] = ()) -> None:
    """:func:`remember` for several messages, with one Redis send (call after commit);
    ``settled``: those of them whose inbox row is done for good."""
    if not message_ids:
        return
    if settled:
        memory.add_many(consumer, settled)
    if conf.DEDUP_BLOOM:
        bloom.add_many(consumer, message_ids)
    if redis.enabled:
        with contextlib.suppress(RedisUnavailable):
            redis.add_many(consumer, message_ids)


def remember_on_commit(consumer: str, message_id: str, *, settled: bool = False) -> None:
    """:func:`remember` once the current transaction commits (at once outside one).

    Consumers call it last, after releasing parked successors: a worker that
    dies before this point leaves no fast-path key, so the redelivery reaches
    the database and releases the successors itself.
    """
    transaction.on_commit(lambda: remember(consumer, message_id, settled=settled))


def forget(consumer: str, message_id: str) -> None:
    """Take back what :func:`remember` said of ``message_id`` (its Redis key): a message
    recorded as handled (parked) whose release failed is delivered to the database again.
    The Bloom filter keeps it (a "maybe" only sends the lookup on to Redis and the database).
    No process's memory holds it: a parked message is not settled.
    """
    memory.discard(consumer, message_id)
    if redis.enabled:
        redis.discard(consumer, message_id)


def flush(timeout: float = 10.0) -> bool:
    """Wait until Redis has the fast-path keys this process remembered so far; False on
    timeout. They are written by a background thread, a few milliseconds after
    :func:`remember` (this process's own lookups see them at once).
    """
    return redis.flush(timeout)


def reset() -> None:
    """Forget this process's memory, Bloom filters and Redis back-off (tests, worker start)."""
    memory.clear()
    bloom.clear()
    redis.reset()
