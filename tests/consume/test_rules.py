"""The built-in rules read two ways agree: the validator on an order, and the column tests
the roads without a read put in their WHERE clause."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idempotent_orders.consuming import registry
from idempotent_orders.consuming.rules import Rule
from idempotent_orders.exceptions import InvalidMessage
from idempotent_orders.models import Order

RULES = [
    registry.validate_payment,
    registry.validate_refund,
    registry.validate_shipment,
    registry.validate_delivery,
]

texts = st.one_of(
    st.sampled_from(["pay_1", "pay_2", "TRK-1", "trk-1", "DHL", "", " "]),
    st.text(max_size=3),
    st.none(),
    st.integers(),
)
amounts = st.one_of(
    st.sampled_from(["10.00", "10", "10.000", "9.99", "0", "-1", "NaN", "1e1", "\uff11\uff10"]),
    st.none(),
    st.integers(),
)
payloads = st.fixed_dictionaries(
    {},
    optional={
        "payment_id": texts,
        "tracking_number": texts,
        "carrier": texts,
        "amount": amounts,
        "currency": st.sampled_from(["EUR", "USD", "eur", None, 1]),
    },
)
orders = st.builds(
    lambda payment_id, tracking, currency: Order(
        amount=Decimal("10.00"),
        currency=currency,
        payment_id=payment_id,
        tracking_number=tracking,
    ),
    st.sampled_from(["", "pay_1", "PAY_1"]),
    st.sampled_from(["", "TRK-1"]),
    st.sampled_from(["EUR", "USD"]),
)


def _holds(order: Order, test: tuple[str, Any, bool]) -> bool:
    column, value, empty_allowed = test
    current = getattr(order, column)
    return current == value or (empty_allowed and current == "")


@pytest.mark.parametrize("rule", RULES, ids=repr)
@settings(max_examples=300, deadline=None)
@given(order=orders, payload=payloads)
def test_the_tests_hold_exactly_when_the_validator_accepts(
    rule: Rule, order: Order, payload: dict[str, Any]
) -> None:
    try:
        written: dict[str, Any] | None = rule(order, payload)
    except InvalidMessage:
        written = None
    read = rule.tests(Order, payload)
    if read is None:
        assert written is None  # rejected whatever the order
        return
    fields, tests = read
    accepted = all(_holds(order, t) for t in tests)
    assert accepted == (written is not None), (tests, written)
    if written is not None:
        assert fields == written


def test_a_payment_against_another_payment_is_refused_with_both_ids() -> None:
    order = Order(amount=Decimal("10.00"), currency="EUR", payment_id="pay_1")
    payload = {"payment_id": "pay_2", "amount": "10.00", "currency": "EUR"}
    with pytest.raises(InvalidMessage, match="payment 'pay_2' differs from the order's payment"):
        registry.validate_payment(order, payload)


def test_a_project_validator_is_not_a_rule() -> None:
    registry.register("test.rule", transition="pay", validate=lambda order, payload: {})
    try:
        handler = registry.get_handler("test.rule")
        assert handler is not None
        assert not isinstance(handler.validate, Rule)
    finally:
        registry._registry.pop("test.rule", None)
