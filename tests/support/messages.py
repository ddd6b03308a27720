"""Message builders: a payment or a shipment event for an order, as a producer sends it."""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Iterator
from typing import Any

from idempotent_orders.models import AbstractOrder

_counter = itertools.count(1)


def payment(
    order: AbstractOrder, *, message_id: str | None = None, seq: int | None = None, **payload: Any
) -> dict[str, Any]:
    body = {
        "payment_id": f"pay-{order.pk}",
        "amount": str(order.amount),
        "currency": order.currency,
    }
    body.update(payload)
    msg: dict[str, Any] = {
        "message_id": message_id or f"pay-msg-{order.pk}-{next(_counter)}",
        "type": "payment.succeeded",
        "order_id": order.pk,
        "payload": body,
    }
    if seq is not None:
        msg["seq"] = seq
    return msg


def shipment(
    order: AbstractOrder,
    kind: str = "dispatched",
    *,
    message_id: str | None = None,
    seq: int | None = None,
    **payload: Any,
) -> dict[str, Any]:
    body = {"tracking_number": f"TRK{order.pk}", "carrier": "sf-express"}
    body.update(payload)
    msg: dict[str, Any] = {
        "message_id": message_id or f"ship-{kind}-{order.pk}-{next(_counter)}",
        "type": f"shipment.{kind}",
        "order_id": order.pk,
        "payload": body,
    }
    if seq is not None:
        msg["seq"] = seq
    return msg


def duplicated_storm(orders: list[AbstractOrder], seed: int) -> list[tuple[str, dict[str, Any]]]:
    """Each order's payment, dispatch and delivery (seq 1-3), each delivered 1-4 times,
    all shuffled: ``(consumer, message)`` pairs, reproducible from ``seed``.
    """
    messages: list[tuple[str, dict[str, Any]]] = []
    for o in orders:
        messages += [
            ("payments", payment(o, message_id=f"p-{o.pk}", seq=1)),
            ("shipping", shipment(o, message_id=f"d-{o.pk}", seq=2)),
            ("shipping", shipment(o, "delivered", message_id=f"c-{o.pk}", seq=3)),
        ]
    rng = random.Random(seed)
    deliveries = [m for m in messages for _ in range(rng.randint(1, 4))]
    rng.shuffle(deliveries)
    return deliveries


@contextlib.contextmanager
def transitions_heard() -> Iterator[list[tuple[Any, ...]]]:
    """What ``order_transitioned`` announces inside the block, as ``(pk, status, version,
    source)``; the list stays readable after it."""
    from idempotent_orders.signals import order_transitioned

    heard: list[tuple[Any, ...]] = []

    def receiver(sender: Any, order: Any, **kwargs: Any) -> None:
        heard.append((order.pk, order.status, order.version, kwargs["source"]))

    order_transitioned.connect(receiver)
    try:
        yield heard
    finally:
        order_transitioned.disconnect(receiver)
