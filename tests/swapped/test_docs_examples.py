"""The pages' examples for a project's own order model, run as written on ``shop.Order``.

``shop.FlowOrder`` is the own-model page's partial payment model (``pay`` with
``RETURN_VALUE("part_paid", "paid")`` recording a ``Payment`` row; its state field is named
``flow``): the page shows its code (``<!-- gen:code tests/shop/models.py#partial-payment -->``).
Each block marked ``<!-- example: name -->`` is read from its page and executed
(tests/support/docs_examples.py); tests/project/test_docs_examples.py runs those of the app's own
order model.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from django.conf import settings
from django.contrib.admin import sites
from django.test import override_settings

from idempotent_orders.consuming import registry
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import Outcome, ProcessedMessage
from tests import shop
from tests.shop import models as shop_models
from tests.shop.models import FlowOrder, Order, Payment
from tests.support.docs_examples import run
from tests.support.messages import payment as payment_of


@pytest.fixture
def saved_registry() -> Iterator[None]:
    saved = dict(registry._registry)
    yield
    registry._registry.clear()
    registry._registry.update(saved)


def payment(order: Any, payment_id: str, amount: str) -> dict[str, Any]:
    return {
        "message_id": f"m-{uuid.uuid4().hex}",
        "type": "payment.succeeded",
        "order_id": order.pk,
        "payload": {"payment_id": payment_id, "amount": amount, "currency": "EUR"},
    }


@pytest.mark.django_db(transaction=True)
def test_the_partial_payment_example_works_as_written(saved_registry: None) -> None:
    order = FlowOrder.objects.create(
        business_key=uuid.uuid4().hex, amount=Decimal("10.00"), currency="EUR"
    )
    with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="shop.FlowOrder"):
        # Without the page's validator, the built-in one wants the whole amount.
        registry.register("payment.succeeded", transition="pay", validate=registry.validate_payment)
        refused = payment(order, "ch_0", "4.00")
        assert consume_message(refused, consumer="payments") is Outcome.REJECTED
        row = ProcessedMessage.objects.get(message_id=refused["message_id"])
        assert "payload.amount 4.00 does not match the order amount 10.00" in row.error

        run("partial-payment-validator")
        handler = registry.get_handler("payment.succeeded")
        assert handler is not None
        assert handler.validate.__name__ == "validate_part_payment"
        assert handler.money
        assert handler.payment_key == "payment_id"

        first = payment(order, "ch_1", "4.00")
        assert consume_message(first, consumer="payments") is Outcome.APPLIED
        # The same payment under a new message id is spent already.
        again = payment(order, "ch_1", "4.00")
        assert consume_message(again, consumer="payments") is Outcome.DUPLICATE
        rest = payment(order, "ch_2", "6.00")
        assert consume_message(rest, consumer="payments") is Outcome.APPLIED
    fresh = FlowOrder.objects.get(pk=order.pk)
    assert (fresh.flow, fresh.paid_total) == ("paid", Decimal("10.00"))
    assert sorted(
        Payment.objects.filter(order_id=order.pk).values_list("payment_id", flat=True)
    ) == [
        "ch_1",
        "ch_2",
    ]
    assert ProcessedMessage.objects.filter(order_id=order.pk, outcome=Outcome.APPLIED).count() == 2


@pytest.mark.django_db(transaction=True)
def test_arguments_pass_what_the_payload_does_not_carry(saved_registry: None) -> None:
    """``arguments=`` builds the call's keyword arguments (here a payment named otherwise)."""
    order = FlowOrder.objects.create(
        business_key=uuid.uuid4().hex, amount=Decimal("10.00"), currency="EUR"
    )

    def pay_arguments(order: Any, payload: Any) -> dict[str, Any]:
        return {"payment_id": f"provider-{payload['charge']}", "amount": payload["total"]}

    registry.register("provider.charge", transition="pay", arguments=pay_arguments)
    message = {
        "message_id": f"m-{uuid.uuid4().hex}",
        "type": "provider.charge",
        "order_id": order.pk,
        "payload": {"charge": "c9", "total": "10.00"},
    }
    with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="shop.FlowOrder"):
        assert consume_message(message, consumer="payments") is Outcome.APPLIED
    assert FlowOrder.objects.get(pk=order.pk).flow == "paid"
    assert list(Payment.objects.filter(order_id=order.pk).values_list("payment_id", flat=True)) == [
        "provider-c9"
    ]


@pytest.mark.django_db
def test_the_own_model_settings_and_binding(saved_registry: None, make_order: Any) -> None:
    scope = run("own-model-settings")
    assert scope["IDEMPOTENT_ORDERS_ORDER_MODEL"] == settings.IDEMPOTENT_ORDERS_ORDER_MODEL
    fulfilment = scope["IDEMPOTENT_ORDERS"]["FULFILMENT_TRANSITION"]
    assert fulfilment == settings.IDEMPOTENT_ORDERS["FULFILMENT_TRANSITION"] == "pick"
    handler = registry.get_handler("payment.succeeded")
    assert handler is not None
    assert (handler.transition, handler.validate) == ("settle", registry.validate_payment)
    order = make_order()
    assert consume_message(payment_of(order), consumer="payments") is Outcome.APPLIED
    order.refresh_from_db()
    assert order.phase == "settled"


@pytest.mark.django_db
def test_the_own_model_admin(monkeypatch: pytest.MonkeyPatch) -> None:
    """operations.md's admin for an own model, on a site of its own (``shop`` is tests.shop)."""
    monkeypatch.setitem(sys.modules, "shop", shop)
    monkeypatch.setitem(sys.modules, "shop.models", shop_models)
    site = sites.AdminSite(name="docs")
    monkeypatch.setattr(sites, "site", site)
    scope = run("own-model-admin")
    model_admin = site._registry[Order]
    assert isinstance(model_admin, scope["OrderAdmin"])
    assert model_admin.check() == []
    assert list(model_admin.operator_transitions) == ["void"]
