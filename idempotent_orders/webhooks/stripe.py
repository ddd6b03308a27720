"""Turning Stripe events into messages: ready-made ``TO_MESSAGE`` functions."""

from __future__ import annotations

from collections.abc import Mapping
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
