"""Turning Stripe events into messages: ready-made ``TO_MESSAGE`` functions.

:func:`to_message` routes an event by its type to the converter of that type
(:data:`CONVERTERS`), so one provider handles several Stripe event types without
a dispatcher of the project's: ``EVENT_TYPES`` says which message type each
becomes, ``TO_MESSAGE = "idempotent_orders.webhooks.stripe.to_message"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any

#: Currencies Stripe counts in whole units (no minor unit): amounts are not divided by 100.
ZERO_DECIMAL = frozenset(
    [
        "BIF",
        "CLP",
        "DJF",
        "GNF",
        "JPY",
        "KMF",
        "KRW",
        "MGA",
        "PYG",
        "RWF",
        "UGX",
        "VND",
        "VUV",
        "XAF",
        "XOF",
        "XPF",
    ]
)


def decimal_amount(minor: int, currency: str) -> str:
    """Stripe's integer amount in ``currency`` as a decimal string (8800 CNY -> ``"88.00"``)."""
    if currency.upper() in ZERO_DECIMAL:
        return str(Decimal(minor))
    return str((Decimal(minor) / 100).quantize(Decimal("0.01")))


def payment_intent(event: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``payment_intent.succeeded`` -> ``(order id, payment payload)``.

    The order id is the intent's ``metadata.order_id`` (set it when creating the
    intent); the payload is what ``payment.succeeded`` takes: ``payment_id`` (the
    intent id), ``amount`` (``amount_received``, as a decimal string) and
    ``currency`` (upper case). Raises ``KeyError``/``ValueError`` on an event
    without them: the event is kept as failed, with why.
    """
    intent = event["data"]["object"]
    currency = str(intent["currency"]).upper()
    minor = intent.get("amount_received", intent.get("amount"))
    if not isinstance(minor, int) or isinstance(minor, bool):
        raise ValueError("the payment intent carries no integer amount")
    return int(intent["metadata"]["order_id"]), {
        "payment_id": str(intent["id"]),
        "amount": decimal_amount(minor, currency),
        "currency": currency,
    }


def _order_id(obj: Mapping[str, Any], payment_id: str) -> int:
    """The order ``obj`` concerns: its ``metadata.order_id``, else the order paid by
    ``payment_id`` (the intent id the ``payment_intent.succeeded`` event recorded)."""
    metadata = obj.get("metadata")
    if isinstance(metadata, Mapping) and metadata.get("order_id") not in (None, ""):
        return int(metadata["order_id"])
    from idempotent_orders import get_order_model

    model = get_order_model()
    # (The configured order model's field; the abstract base does not declare it.)
    paid_by = {"payment_id": payment_id}
    found = model._default_manager.filter(**paid_by).values_list("pk", flat=True).first()
    if found is None:
        raise LookupError(f"no metadata.order_id and no order paid by {payment_id!r}")
    return int(found)


def _minor(obj: Mapping[str, Any], *names: str) -> int:
    for name in names:
        value = obj.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError(f"the object carries no integer {' or '.join(names)}")


def charge_refunded(event: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``charge.refunded`` -> ``(order id, refund payload)`` for ``payment.refunded``.

    ``payment_id`` is the charge's ``payment_intent`` (the id the payment recorded; the
    charge id when it has none), ``amount`` its ``amount_refunded``. The order is the
    charge's ``metadata.order_id``, else the order paid by that intent.
    """
    charge = event["data"]["object"]
    currency = str(charge["currency"]).upper()
    payment_id = str(charge.get("payment_intent") or charge["id"])
    return _order_id(charge, payment_id), {
        "payment_id": payment_id,
        "amount": decimal_amount(_minor(charge, "amount_refunded", "amount"), currency),
        "currency": currency,
    }


def charge_dispute_created(event: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``charge.dispute.created`` -> ``(order id, dispute payload)``.

    No built-in message type takes a dispute: map it to a type the project registers
    (e.g. ``payment.disputed``). The payload: ``payment_id`` (the intent, else the
    charge), ``dispute_id``, ``amount``, ``currency`` and ``reason``.
    """
    dispute = event["data"]["object"]
    currency = str(dispute["currency"]).upper()
    payment_id = str(dispute.get("payment_intent") or dispute["charge"])
    return _order_id(dispute, payment_id), {
        "payment_id": payment_id,
        "dispute_id": str(dispute["id"]),
        "amount": decimal_amount(_minor(dispute, "amount"), currency),
        "currency": currency,
        "reason": str(dispute.get("reason") or ""),
    }


def payment_intent_canceled(event: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``payment_intent.canceled`` -> ``(order id, {})`` for ``order.cancelled`` (which
    takes no payload): the intent's ``metadata.order_id``."""
    intent = event["data"]["object"]
    return int(intent["metadata"]["order_id"]), {}


#: Stripe event type -> its converter; :func:`to_message` routes by it.
CONVERTERS: dict[str, Callable[[Mapping[str, Any]], tuple[Any, dict[str, Any]]]] = {
    "payment_intent.succeeded": payment_intent,
    "payment_intent.canceled": payment_intent_canceled,
    "charge.refunded": charge_refunded,
    "charge.dispute.created": charge_dispute_created,
}


def to_message(event: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Any event type of :data:`CONVERTERS`, converted by its own converter (a type it
    does not know raises ``KeyError``: the event is kept as failed, with why)."""
    kind = event.get("type")
    converter = CONVERTERS.get(kind) if isinstance(kind, str) else None
    if converter is None:
        raise KeyError(f"no Stripe converter for event type {kind!r}; known: {sorted(CONVERTERS)}")
    return converter(event)
