"""An operator transition whose body picks the target (django-SHOP's ``cancel_order``)
gets an admin action; its confirmation page names the states it may end in."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from idempotent_orders.checks import check_operator_transitions
from idempotent_orders.consuming.single import consume_message
from tests.djshop.test_workflow import checked_out, events, message_types  # noqa: F401

pytestmark = pytest.mark.django_db


def test_cancel_order_is_an_action_that_shows_where_it_may_end(staff: Client) -> None:
    order = checked_out()
    url = reverse("admin:djshop_order_changelist")
    listing = staff.get(url)
    choices = dict(listing.context["action_form"].fields["action"].choices)
    assert choices["transition_cancel_order"] == (
        "Cancel order (ends as order_canceled or refund_payment)"
    )
    assert "transition_acknowledge_prepayment" not in choices
    data = {"action": "transition_cancel_order", "_selected_action": [str(order.pk)]}
    page = staff.post(url, data).content.decode()
    assert "are you sure?" in page
    assert "awaiting_payment -&gt; order_canceled or refund_payment (its body decides)" in page
    done = staff.post(
        url, {**data, "post": "yes", f"version-{order.pk}": str(order.version)}, follow=True
    )
    assert done.status_code == 200
    # The message says where the body took the order, not the choice it had.
    said = [str(m) for m in done.context["messages"]]
    assert f"Order {order.pk}: awaiting_payment -> order_canceled" in said
    order.refresh_from_db()
    assert order.status == "order_canceled"


def test_a_paid_order_cancelled_by_the_operator_is_refunded(staff: Client) -> None:
    order = checked_out()
    consume_message(events(order)[0], consumer="shop")
    order.refresh_from_db()
    url = reverse("admin:djshop_order_changelist")
    data = {
        "action": "transition_cancel_order",
        "_selected_action": [str(order.pk)],
        "post": "yes",
        f"version-{order.pk}": str(order.version),
    }
    staff.post(url, data, follow=True)
    order.refresh_from_db()
    assert (order.status, order.hooks) == ("refund_payment", "withdraw;refund;")


def test_operator_transitions_without_an_action_are_named() -> None:
    warnings = [w for w in check_operator_transitions() if w.id == "idempotent_orders.W046"]
    assert sorted(w.msg.split("'")[1] for w in warnings) == ["acknowledge_prepayment", "close"]
