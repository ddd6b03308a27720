"""Mark an effect outside the database (an e-mail, a payment capture, an HTTP call) in the
project's own code, so that the testing kit counts it per business event::

    from idempotent_orders.effects import effect

    with effect("gateway.capture", payment_id=order.payment_id):
        gateway.capture(order.payment_id, order.amount)

Outside a test that watches effects
(:func:`idempotent_orders.testing.watch_effects`) the block costs one check of an
empty list and does nothing else. The keyword arguments name the business event: two
calls with the same name and the same keywords are the same effect, done twice.
Without keywords, the event is the message being consumed (its consumer and id).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["effect"]

#: Called as ``observer(name, key)`` when a marked effect starts; the testing kit's.
_observers: list[Callable[[str, dict[str, Any]], None]] = []


@contextmanager
def effect(name: str, /, **key: Any) -> Iterator[None]:
    """The block is the effect ``name`` for the business event ``key``: see the module."""
    for observe in tuple(_observers):
        observe(name, key)
    yield
