"""Bad-input corpus: messages that must each end as a ``rejected`` inbox record with a reason."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from idempotent_orders.models import Order


@dataclass(frozen=True)
class BadCase:
    name: str
    message: Any
    #: A fragment the stored reason must contain (lower case).
    reason: str
    #: False for inputs a JSON broker cannot carry (sets, Decimals, absurd nesting).
    over_the_wire: bool = True


def _pay(order: Order, mid: str, **payload: Any) -> dict[str, Any]:
    body = {"payment_id": f"pay-{order.pk}", "amount": str(order.amount), "currency": "CNY"}
    body.update(payload)
    return {"message_id": mid, "type": "payment.succeeded", "order_id": order.pk, "payload": body}


def _ship(order: Order, mid: str, **payload: Any) -> dict[str, Any]:
    body = {"tracking_number": f"T{order.pk}", "carrier": "sf"}
    body.update(payload)
    return {"message_id": mid, "type": "shipment.dispatched", "order_id": order.pk, "payload": body}


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"x": value}
    return value


def corpus(order: Order, cancelled: Order, *, tag: str) -> list[BadCase]:
    """Bad messages against ``order`` (pending payment, amount 12.50 CNY) and a cancelled one.

    Message ids carry ``tag`` so repeated runs in one database do not collide.
    """
    pk = order.pk

    def mid(name: str) -> str:
        return f"bad-{tag}-{name}"

    valid_head = {"type": "payment.succeeded", "order_id": pk}
    cases = [
        # Malformed envelopes.
        BadCase("list", [1, 2, 3], "json object"),
        BadCase("string", "payment.succeeded", "json object"),
        BadCase("null", None, "json object"),
        BadCase("number", 42, "json object"),
        BadCase("empty", {}, "message_id"),
        BadCase("no-id", {**valid_head, "payload": {}}, "message_id"),
        BadCase("empty-id", {**valid_head, "message_id": ""}, "message_id"),
        BadCase("int-id", {**valid_head, "message_id": 12345}, "message_id"),
        BadCase("long-id", {**valid_head, "message_id": "x" * 256}, "message_id"),
        BadCase("padded-id", {**valid_head, "message_id": f" {mid('padded')} "}, "message_id"),
        BadCase("newline-id", {**valid_head, "message_id": mid("nl") + "\n"}, "message_id"),
        BadCase("zero-width-id", {**valid_head, "message_id": mid("zw") + "\u200b"}, "message_id"),
        BadCase("no-type", {"message_id": mid("no-type"), "order_id": pk}, "type"),
        BadCase("int-type", {"message_id": mid("int-type"), "type": 7, "order_id": pk}, "type"),
        BadCase(
            "unknown-type",
            {"message_id": mid("unknown-type"), "type": "payment.exploded", "order_id": pk},
            "unknown message type",
        ),
        # Wrong types and ranges.
        BadCase("no-order", {"message_id": mid("no-order"), "type": "order.cancelled"}, "order_id"),
        BadCase("negative-order", {**_pay(order, mid("neg-order")), "order_id": -pk}, "order_id"),
        BadCase("zero-order", {**_pay(order, mid("zero-order")), "order_id": 0}, "order_id"),
        BadCase("bool-order", {**_pay(order, mid("bool-order")), "order_id": True}, "order_id"),
        BadCase(
            "float-order", {**_pay(order, mid("float-order")), "order_id": pk + 0.5}, "order_id"
        ),
        BadCase("text-order", {**_pay(order, mid("text-order")), "order_id": "abc"}, "order_id"),
        BadCase("negative-seq", {**_pay(order, mid("neg-seq")), "seq": -1}, "seq"),
        BadCase("zero-seq", {**_pay(order, mid("zero-seq")), "seq": 0}, "seq"),
        BadCase("text-seq", {**_pay(order, mid("text-seq")), "seq": "1"}, "seq"),
        BadCase("bool-seq", {**_pay(order, mid("bool-seq")), "seq": True}, "seq"),
        BadCase("huge-seq", {**_pay(order, mid("huge-seq")), "seq": 2**40}, "seq"),
        BadCase("list-payload", {**_pay(order, mid("list-payload")), "payload": [1]}, "payload"),
        # Size and characters.
        BadCase(
            "10mb-payload",
            _pay(order, mid("10mb"), note="A" * (10 * 1024 * 1024)),
            "bytes, the limit",
        ),
        BadCase("nul-in-payload", _pay(order, mid("nul"), payment_id="pay\x00ment"), "nul"),
        BadCase("nul-in-type", {**_pay(order, mid("nul-type")), "type": "payment\x00"}, "nul"),
        BadCase(
            "unicode-digits-amount",
            _pay(order, mid("fullwidth"), amount="\uff11\uff12.\uff15\uff10"),
            "amount",
        ),
        BadCase(
            "lone-surrogate", _pay(order, mid("surrogate"), payment_id="pay-\ud800"), "surrogate"
        ),
        BadCase("emoji-currency", _pay(order, mid("emoji-currency"), currency="¥💴"), "currency"),
        BadCase(
            "deep-nesting",
            {**_pay(order, mid("deep")), "payload": _nested(5000)},
            "json",
            over_the_wire=False,
        ),
        BadCase("not-json", _pay(order, mid("set"), amount={"12.50"}), "json", over_the_wire=False),
        # SQL-looking strings are data, never code.
        BadCase(
            "sql-payment-id",
            _pay(
                order,
                mid("sql"),
                payment_id="x'; DROP TABLE idempotent_orders_order; --",
                currency="USD",
            ),
            "currency",
        ),
        BadCase(
            "sql-message-id",
            {"message_id": "1' OR '1'='1", "type": "payment.unknown", "order_id": pk},
            "unknown message type",
        ),
        # Money.
        BadCase("negative-amount", _pay(order, mid("neg-amount"), amount="-12.50"), "positive"),
        BadCase("zero-amount", _pay(order, mid("zero-amount"), amount="0.00"), "positive"),
        BadCase(
            "mismatched-amount", _pay(order, mid("mismatch"), amount="12.49"), "does not match"
        ),
        BadCase("float-amount", _pay(order, mid("float-amount"), amount=12.5), "decimal string"),
        BadCase("nan-amount", _pay(order, mid("nan"), amount="NaN"), "positive"),
        BadCase("inf-amount", _pay(order, mid("inf"), amount="Infinity"), "positive"),
        BadCase("word-amount", _pay(order, mid("word"), amount="twelve"), "not a decimal"),
        BadCase("wrong-currency", _pay(order, mid("usd"), currency="USD"), "currency"),
        BadCase("no-payment-id", _pay(order, mid("no-pid"), payment_id=None), "payment_id"),
        BadCase("blank-payment-id", _pay(order, mid("blank-pid"), payment_id="   "), "payment_id"),
        BadCase("long-payment-id", _pay(order, mid("long-pid"), payment_id="p" * 129), "longer"),
        BadCase("ship-no-tracking", _ship(order, mid("no-trk"), tracking_number=None), "tracking"),
        BadCase("ship-int-carrier", _ship(order, mid("int-carrier"), carrier=5), "carrier"),
        # Unknown and impossible targets.
        BadCase(
            "unknown-order",
            _pay(order, mid("unknown-order")) | {"order_id": 2**31},
            "unknown order",
        ),
        BadCase(
            "pay-cancelled-order",
            _pay(cancelled, mid("pay-cancelled")) | {"order_id": cancelled.pk},
            "never",
        ),
    ]
    return cases


@dataclass(frozen=True)
class BadBody:
    """A body the orders API must answer with a ``400 invalid-order`` problem, storing nothing."""

    name: str
    body: bytes


def _order_with(**fields: Any) -> bytes:
    base: dict[str, Any] = {
        "amount": "12.50",
        "currency": "CNY",
        "items": [{"sku": "tea", "quantity": 1}],
    }
    return json.dumps({**base, **fields}, ensure_ascii=False).encode()


#: Bodies that once answered 500 (or were accepted where the consumer refuses them).
HTTP_BAD_BODIES = [
    BadBody("deep-array", b"[" * 50_000 + b"]" * 50_000),
    # Small enough for a tight MAX_REQUEST_BYTES, still past the decoder's recursion limit.
    BadBody("deep-array-small", b"[" * 3_000 + b"]" * 3_000),
    BadBody("deep-object", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
    BadBody(
        "deep-in-amount",
        _order_with(amount="x")[:-1] + b',"x":' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    ),
    BadBody("amount-1e30", _order_with(amount="1e30")),
    BadBody("amount-forty-nines", _order_with(amount="9" * 40)),
    BadBody("amount-forty-nines-cents", _order_with(amount="9" * 40 + ".99")),
    BadBody("amount-exponent", _order_with(amount="1E+2")),
    BadBody("amount-huge-exponent", _order_with(amount="1e999999999")),
    BadBody("amount-fullwidth", _order_with(amount="\uff11\uff12.\uff15\uff10")),
    BadBody("amount-arabic-indic", _order_with(amount="\u0661\u0662.\u0665\u0660")),
    BadBody("amount-underscore", _order_with(amount="1_2.50")),
    BadBody("amount-padded", _order_with(amount=" 12.50 ")),
    BadBody("amount-plus", _order_with(amount="+12.50")),
    BadBody("quantity-huge", _order_with(items=[{"sku": "tea", "quantity": 10**400}])),
]
