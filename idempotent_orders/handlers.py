"""Registry of message types: each names the Order transition it drives and checks its payload.

Add a type with :func:`register`; the five built-in types are registered below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from idempotent_orders.exceptions import InvalidMessage
from idempotent_orders.models import Order

#: Turns (order, payload) into the extra columns the transition writes; raises InvalidMessage.
Validator = Callable[[Order, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class MessageHandler:
    message_type: str
    #: Name of an ``@transition`` method on Order.
    transition: str
    validate: Validator
    #: Consumers allowed to receive this type; empty means any.
    consumers: frozenset[str] = frozenset()


_registry: dict[str, MessageHandler] = {}


def register(
    message_type: str,
    *,
    transition: str,
    validate: Validator | None = None,
    consumers: frozenset[str] | set[str] | None = None,
) -> None:
    """Make ``message_type`` drive ``Order.<transition>``; ``validate`` checks the payload.

    ``consumers`` restricts which consumers accept the type (others reject it).
    """
    from idempotent_orders.transitions import edge

    edge(Order, transition)  # fails early on a name that is not a declared transition
    _registry[message_type] = MessageHandler(
        message_type=message_type,
        transition=transition,
        validate=validate or _no_payload,
        consumers=frozenset(consumers or ()),
    )


def get_handler(message_type: str) -> MessageHandler | None:
    return _registry.get(message_type)


def message_types() -> list[str]:
    return sorted(_registry)


def _no_payload(order: Order, payload: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _text(payload: Mapping[str, Any], key: str, *, max_length: int) -> str:
    value = payload.get(key)
    if not isinstance(value, str) or not value.strip():
        raise InvalidMessage(f"payload.{key} must be a non-empty string")
    if len(value) > max_length:
        raise InvalidMessage(f"payload.{key} is longer than {max_length} characters")
    return value


def _check_money(order: Order, payload: Mapping[str, Any]) -> None:
    raw = payload.get("amount")
    if not isinstance(raw, str):
        raise InvalidMessage("payload.amount must be a decimal string such as '12.50'")
    if not raw.isascii():
        # Decimal() reads any Unicode digit (fullwidth "12.50" too); amounts are ASCII.
        raise InvalidMessage(f"payload.amount {raw[:40]!r} must use ASCII digits")
    try:
        amount = Decimal(raw)
    except InvalidOperation:
        raise InvalidMessage(f"payload.amount {raw[:40]!r} is not a decimal number") from None
    if not amount.is_finite() or amount <= 0:
        raise InvalidMessage(f"payload.amount {raw[:40]!r} must be a positive amount")
    if amount != order.amount:
        raise InvalidMessage(
            f"payload.amount {amount} does not match the order amount {order.amount}"
        )
    currency = payload.get("currency")
    if currency != order.currency:
        raise InvalidMessage(
            f"payload.currency {str(currency)[:8]!r} does not match the order currency "
            f"{order.currency!r}"
        )


def validate_payment(order: Order, payload: Mapping[str, Any]) -> dict[str, Any]:
    payment_id = _text(payload, "payment_id", max_length=128)
    _check_money(order, payload)
    if order.payment_id and order.payment_id != payment_id:
        raise InvalidMessage(
            f"payment {payment_id[:40]!r} differs from the order's payment {order.payment_id!r}"
        )
    return {"payment_id": payment_id}


def validate_refund(order: Order, payload: Mapping[str, Any]) -> dict[str, Any]:
    payment_id = _text(payload, "payment_id", max_length=128)
    _check_money(order, payload)
    if order.payment_id and order.payment_id != payment_id:
        raise InvalidMessage(
            f"refund of payment {payment_id[:40]!r}, order paid by {order.payment_id!r}"
        )
    return {}


def validate_shipment(order: Order, payload: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "tracking_number": _text(payload, "tracking_number", max_length=128),
        "carrier": _text(payload, "carrier", max_length=64),
    }


def validate_delivery(order: Order, payload: Mapping[str, Any]) -> dict[str, Any]:
    tracking = _text(payload, "tracking_number", max_length=128)
    if order.tracking_number and order.tracking_number != tracking:
        raise InvalidMessage(
            f"delivery of parcel {tracking[:40]!r}, order shipped as {order.tracking_number!r}"
        )
    return {}


register("payment.succeeded", transition="pay", validate=validate_payment)
register("payment.refunded", transition="refund", validate=validate_refund)
register("shipment.dispatched", transition="ship", validate=validate_shipment)
register("shipment.delivered", transition="complete", validate=validate_delivery)
register("order.cancelled", transition="cancel")
#: Internal: the fulfilment step without a warehouse call. The leased path
#: (idempotent_orders.fulfilment.fulfil) records the same inbox row; an outside
#: producer cannot send this type to the payment or shipping consumers.
register("order.fulfilment", transition="start_processing", consumers={"fulfilment"})
