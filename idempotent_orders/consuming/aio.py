"""The consume road from async code: ``aconsume_message`` and ``aconsume_batch``.

Django's async ORM has no transactions, and the guarantee lives in one: the
inbox row and the order's conditional UPDATE commit together or not at all.
So each call runs the sync road (:func:`~idempotent_orders.consuming.single.consume_message`,
:func:`~idempotent_orders.consuming.batch.consume_batch`) in a worker thread, one
transaction per message (per chunk for a batch), exactly as a Celery worker runs it.

Which thread: ``thread_sensitive=False`` by default. ``sync_to_async``'s
``thread_sensitive=True`` would put every call of the process on one shared thread
(one connection, one message at a time): correct, but a storm of deliveries from an
event loop would queue behind each other and behind every other thread-sensitive
call (an ASGI request's ORM work included). With ``False`` each call runs on a
thread of the event loop's default executor, each thread with its own database
connection, so as many messages are in flight as the executor has threads (set
``loop.set_default_executor`` to bound the connections). The guarantee does not
rest on which thread runs a message: duplicates racing on several connections
meet the inbox's unique index and the order's ``version``, as they do across
Celery worker processes. The connection is handled as Django handles a request's:
``close_old_connections()`` before and after, so ``CONN_MAX_AGE`` and broken
connections are honoured. Pass ``thread_sensitive=True`` when the caller needs
the thread-sensitive context (say, to share a connection with code around it).

``MessageFailed`` (and database errors) propagate to the awaiting coroutine as they
do from the sync road.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import Outcome

__all__ = ["aconsume_batch", "aconsume_message"]

_T = TypeVar("_T")


def _in_worker_thread(call: Callable[[], _T]) -> _T:
    """Run ``call`` with the thread's connection handled as around a request."""
    close_old_connections()
    try:
        return call()
    finally:
        close_old_connections()


async def aconsume_message(
    message: Any, *, consumer: str, thread_sensitive: bool = False
) -> Outcome:
    """Apply one message to its order exactly once, from async code.

    :func:`~idempotent_orders.consuming.single.consume_message` in a worker thread
    (its own transaction); the same outcome, the same exceptions.
    """
    run = sync_to_async(_in_worker_thread, thread_sensitive=thread_sensitive)
    return await run(functools.partial(consume_message, message, consumer=consumer))


async def aconsume_batch(
    messages: Sequence[Any], *, consumer: str, thread_sensitive: bool = False
) -> list[Outcome]:
    """Consume ``messages`` exactly once each, from async code; outcomes in input order.

    :func:`~idempotent_orders.consuming.batch.consume_batch` in a worker thread.
    """
    run = sync_to_async(_in_worker_thread, thread_sensitive=thread_sensitive)
    return await run(functools.partial(consume_batch, messages, consumer=consumer))
