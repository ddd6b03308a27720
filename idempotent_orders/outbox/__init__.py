"""Transactional outbox: task messages written with the producer's data, published by a relay.

Everything public is importable from here (``from idempotent_orders.outbox import
publish_on_commit``). One module per concept, each importing only the ones
before it (``tests/project/test_structure.py`` keeps it so):

1. :mod:`~idempotent_orders.outbox.failures`: a failed publish: the broker
   breaker, the row's backoff, its dead letter.
2. :mod:`~idempotent_orders.outbox.sender`: how a row reaches the broker:
   ``apply_async``, the batch's templated publish, the batch's producer.
3. :mod:`~idempotent_orders.outbox.relay`: ``relay_outbox``: due rows locked or
   leased, published and marked sent in batches; the listener of its loop.
4. :mod:`~idempotent_orders.outbox.thread`: the in-process publisher thread.
5. :mod:`~idempotent_orders.outbox.producer`: ``publish_on_commit``: the row
   written in the caller's transaction, published after commit.
6. :mod:`~idempotent_orders.outbox.upkeep`: the operator's tools: requeue,
   purge, stats.

To replace a name in a test, patch it in the module that defines it (the others
look it up there): ``idempotent_orders.outbox.sender._send``,
``idempotent_orders.outbox.thread.publisher``. The names below are the same
objects, bound once at import.
"""

from __future__ import annotations

from idempotent_orders.exceptions import PermanentPublishError
from idempotent_orders.outbox.failures import Breaker, breaker, is_transport_error
from idempotent_orders.outbox.producer import publish_on_commit
from idempotent_orders.outbox.relay import (
    NOTIFY_CHANNEL,
    Batch,
    OutboxListener,
    RelayResult,
    relay_outbox,
)
from idempotent_orders.outbox.sender import TEMPLATE_TTL
from idempotent_orders.outbox.thread import Publisher, flush_publisher, publisher
from idempotent_orders.outbox.upkeep import outbox_stats, purge_outbox, requeue_outbox

#: The modules of the outbox, lowest first: each imports only modules before it.
LAYERS = ("failures", "sender", "relay", "thread", "producer", "upkeep")

__all__ = [
    "NOTIFY_CHANNEL",
    "TEMPLATE_TTL",
    "Batch",
    "Breaker",
    "OutboxListener",
    "PermanentPublishError",
    "Publisher",
    "RelayResult",
    "breaker",
    "flush_publisher",
    "is_transport_error",
    "outbox_stats",
    "publish_on_commit",
    "publisher",
    "purge_outbox",
    "relay_outbox",
    "requeue_outbox",
]
