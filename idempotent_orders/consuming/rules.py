"""The built-in payload rules, defined once as data.

A rule says what a message type's payload must hold and what it writes on the order:
the payload texts it needs, whether its amount and currency must match the order's,
the columns it writes from the payload, and the columns that must be empty or equal
to a payload value. The same definition is read two ways:

- called as a validator, ``rule(order, payload)``, by
  :func:`~idempotent_orders.consuming.decision.decide` on the order as read: it returns
  the columns to write or raises :class:`~idempotent_orders.exceptions.InvalidMessage`
  with the reason;
- :meth:`Rule.tests` gives the same conditions as column tests (column, value, empty
  allowed), which the roads that skip the read put in the UPDATE's WHERE clause. It
  returns None wherever the validator would reject the payload whatever the order, so
  such a message takes the read and is rejected with its reason.

A project's own validator (any other callable) is never read as tests: its message
always takes the read.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db.models import Model

from idempotent_orders.exceptions import InvalidMessage

__all__ = ["Rule", "Same", "Test", "Text"]

#: ``(field name, value, empty_allowed)``: the column must equal ``value`` (or be empty).
Test = tuple[str, Any, bool]


@dataclass(frozen=True)
class Text:
    """A payload entry that must be a non-empty string of at most ``max_length``."""

    key: str
    max_length: int


@dataclass(frozen=True)
class Same:
    """The order's ``column`` must be empty or equal the payload's ``key``.

    ``refusal`` is formatted with ``value`` (the payload's, cut to 40 characters) and
    ``current`` (the order's).
    """

    column: str
    key: str
    refusal: str


@dataclass(frozen=True)
class Rule:
    """A validator defined as data (see the module's docstring)."""

    name: str
    texts: tuple[Text, ...] = ()
    #: ``payload.amount`` is a positive decimal string equal to the order's ``amount``,
    #: and ``payload.currency`` equals its ``currency`` (each where the model has it).
    money: bool = False
    #: Payload texts written to the columns of the same name (where the model has them).
    writes: tuple[str, ...] = ()
    same: tuple[Same, ...] = ()

    def __call__(self, order: Any, payload: Mapping[str, Any]) -> dict[str, Any]:
        texts = {t.key: _text(payload, t.key, max_length=t.max_length) for t in self.texts}
        names = _field_names(_model_of(order))
        if self.money:
            _check_money(order, names, payload)
        for same in self.same:
            current = getattr(order, same.column) if same.column in names else ""
            value = texts[same.key]
            if current and current != value:
                raise InvalidMessage(same.refusal.format(value=value[:40], current=current))
        return {key: texts[key] for key in self.writes if key in names}

    def tests(
        self, model: type[Model], payload: Mapping[str, Any]
    ) -> tuple[dict[str, Any], list[Test]] | None:
        """The columns written and the column tests that hold exactly when ``self`` accepts
        ``payload`` for an order of ``model``; None where it rejects it whatever the order."""
        try:
            texts = {t.key: _text(payload, t.key, max_length=t.max_length) for t in self.texts}
        except InvalidMessage:
            return None
        names = _field_names(model)
        tests: list[Test] = []
        if self.money:
            money = _money_tests(names, payload)
            if money is None:
                return None
            tests += money
        tests += [(s.column, texts[s.key], True) for s in self.same if s.column in names]
        return {key: texts[key] for key in self.writes if key in names}, tests

    def __repr__(self) -> str:
        return f"<rule {self.name}>"


def _model_of(order: Model) -> type[Model]:
    return type(order)


@functools.cache
def _field_names(model: type[Model]) -> frozenset[str]:
    return frozenset(f.name for f in model._meta.concrete_fields)


def _text(payload: Mapping[str, Any], key: str, *, max_length: int) -> str:
    value = payload.get(key)
    if not isinstance(value, str) or not value.strip():
        raise InvalidMessage(f"payload.{key} must be a non-empty string")
    if len(value) > max_length:
        raise InvalidMessage(f"payload.{key} is longer than {max_length} characters")
    return value


def _amount(payload: Mapping[str, Any]) -> Decimal:
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
    return amount


def _check_money(order: Any, names: frozenset[str], payload: Mapping[str, Any]) -> None:
    amount = _amount(payload)
    if "amount" in names and amount != order.amount:
        raise InvalidMessage(
            f"payload.amount {amount} does not match the order amount {order.amount}"
        )
    currency = payload.get("currency")
    if "currency" in names and currency != order.currency:
        raise InvalidMessage(
            f"payload.currency {str(currency)[:8]!r} does not match the order currency "
            f"{order.currency!r}"
        )


def _money_tests(names: frozenset[str], payload: Mapping[str, Any]) -> list[Test] | None:
    try:
        amount = _amount(payload)
    except InvalidMessage:
        return None
    tests: list[Test] = []
    if "amount" in names:
        tests.append(("amount", amount, False))
    if "currency" in names:
        currency = payload.get("currency")
        if not isinstance(currency, str):
            return None  # never equal to a column value: the validator rejects it
        tests.append(("currency", currency, False))
    return tests


PAYMENT_ID = Text("payment_id", 128)
TRACKING = Text("tracking_number", 128)

#: A payment: its id (written on the order), amount and currency.
PAYMENT = Rule(
    "payment",
    texts=(PAYMENT_ID,),
    money=True,
    writes=("payment_id",),
    same=(
        Same(
            "payment_id",
            "payment_id",
            "payment {value!r} differs from the order's payment {current!r}",
        ),
    ),
)
#: A refund of the order's payment.
REFUND = Rule(
    "refund",
    texts=(PAYMENT_ID,),
    money=True,
    same=(
        Same("payment_id", "payment_id", "refund of payment {value!r}, order paid by {current!r}"),
    ),
)
#: A parcel dispatched: its tracking number and carrier (written on the order).
SHIPMENT = Rule(
    "shipment",
    texts=(TRACKING, Text("carrier", 64)),
    writes=("tracking_number", "carrier"),
)
#: The parcel the order was shipped as, delivered.
DELIVERY = Rule(
    "delivery",
    texts=(TRACKING,),
    same=(
        Same(
            "tracking_number",
            "tracking_number",
            "delivery of parcel {value!r}, order shipped as {current!r}",
        ),
    ),
)
#: No payload.
NOTHING = Rule("nothing")
