"""Message builders: a payment or a shipment event for an order, as a producer sends it."""

from __future__ import annotations

import itertools
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
