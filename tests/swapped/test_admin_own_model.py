"""The admin on a project's own order model: ``shop.Order`` registered with ``OrderAdminMixin``.

``shop.Order`` names its state ``phase`` (new, settled, picking, on hold, sent,
received, voided), has no ``payment_id`` or ``carrier``, a condition on
``settle``, a permission on ``void`` and an extra transition ``hold`` driven by
``warehouse.held``. Its admin (tests/shop/admin.py) makes ``void`` the
operator's decision. This module runs under ``tests.settings_swapped``.
"""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from demo_project import warehouse
from idempotent_orders.admin import OrderAdminMixin
from idempotent_orders.consuming import registry
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.exceptions import InvalidMessage
from idempotent_orders.fulfilment import fulfilment_message_id
from idempotent_orders.models import (
    AuditEntry,
    InboxStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.models import Order as DefaultOrder
from tests.shop.models import Order, Phase
from tests.support.admin import form_data, shown
from tests.support.messages import payment, shipment

pytestmark = pytest.mark.django_db


def url(view: str, *args: Any) -> str:
    return reverse(f"admin:shop_order_{view}", args=args)


def ask(client: Client, action: str, *orders: Order) -> Any:
    return client.post(
        url("changelist"), {"action": action, "_selected_action": [str(o.pk) for o in orders]}
    )


def confirm(client: Client, action: str, *orders: Order) -> Any:
    data: dict[str, Any] = {
        "action": action,
        "_selected_action": [str(o.pk) for o in orders],
        "post": "yes",
    }
    for order in orders:
        data[f"version-{order.pk}"] = str(Order.objects.get(pk=order.pk).version)
    return client.post(url("changelist"), data, follow=True)


def phase(order: Order) -> str:
    return Order.objects.get(pk=order.pk).phase


def test_only_the_configured_model_has_an_order_admin(staff) -> None:
    assert admin.site.is_registered(Order)
    assert isinstance(admin.site.get_model_admin(Order), OrderAdminMixin)
    assert not admin.site.is_registered(DefaultOrder)  # swapped out, like auth.User
    page = staff.get(url("changelist"))
    assert page.status_code == 200
    labels = {
        name: str(label) for name, label in page.context["action_form"].fields["action"].choices
    }
    transitions = {name for name in labels if name.startswith("transition_")}
    assert transitions == {
        f"transition_{name}" for name in ("settle", "pick", "hold", "send", "receive", "void")
    }
    assert labels["transition_void"] == "Mark as voided"
    assert labels["transition_hold"] == "Mark as on hold"
    assert labels["transition_pick"].startswith("Start fulfilment")


# -- the change form ----------------------------------------------------------------------------


def test_message_owned_fields_are_read_only(staff, make_order) -> None:
    order = make_order()
    page = staff.get(url("change", order.pk))
    form = page.context["adminform"].form
    sections = [(title, spec["fields"]) for title, spec in page.context["adminform"].fieldsets]
    assert ("Written by messages", ["tracking_number", "last_seq", "has_parked"]) in sections
    owned = {"phase", "version", "last_seq", "has_parked", "tracking_number", "business_key"}
    assert not owned & set(form.fields)
    assert {"amount", "currency", "blocked", "customer"} <= set(form.fields)
    consume_message(payment(order), consumer="payments")
    form = staff.get(url("change", order.pk)).context["adminform"].form
    # Settled: it left its initial state, so the amount the payment was checked against is fixed.
    assert not {"amount", "currency"} & set(form.fields)
    assert "blocked" in form.fields


def test_stale_form_overwrites_nothing_and_names_what_changed(staff, make_order) -> None:
    order = make_order()
    change = url("change", order.pk)
    page = staff.get(change)
    assert page.status_code == 200
    data = form_data(page)
    data["amount"] = "99.00"

    # A worker applies the payment while the operator looks at the form.
    assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    response = staff.post(change, data)

    assert response.status_code == 200, "a stale save must be refused, not redirected"
    errors = " ".join(response.context["adminform"].form.non_field_errors())
    assert "v0 -> v1" in errors
    assert "phase" in errors
    assert "Nothing was saved" in errors
    fresh = Order.objects.get(pk=order.pk)
    assert (fresh.phase, fresh.version, fresh.amount) == (Phase.SETTLED, 1, Decimal("12.50"))


def test_fresh_form_saves_with_a_version_bump(staff, make_order) -> None:
    order = make_order()
    change = url("change", order.pk)
    data = form_data(staff.get(change))
    data["blocked"] = "on"
    assert staff.post(change, data).status_code == 302
    fresh = Order.objects.get(pk=order.pk)
    assert (fresh.blocked, fresh.version, fresh.phase) == (True, 1, Phase.NEW)


def test_orders_can_be_added(staff) -> None:
    response = staff.post(
        url("add"), {"business_key": "by-hand-1", "amount": "5.00", "currency": "CNY"}
    )
    assert response.status_code == 302
    order = Order.objects.get(business_key="by-hand-1")
    assert (order.phase, order.version, order.amount) == (Phase.NEW, 0, Decimal("5.00"))


# -- transition actions -------------------------------------------------------------------------


def test_void_asks_first_then_applies_once(staff, make_order) -> None:
    new, settled = make_order(), make_order()
    consume_message(payment(settled), consumer="payments")
    page = ask(staff, "transition_void", new, settled)
    assert page.status_code == 200
    html = page.content.decode()
    assert "Are you sure" in html
    assert "new -&gt; voided" in html
    assert "cannot void from settled" in html
    assert "<td>settled</td>" in html  # the state column reads the model's own field
    assert phase(new) == Phase.NEW
    assert not AuditEntry.objects.exists()

    said = shown(confirm(staff, "transition_void", new, settled))
    assert f"Order {new.pk}: new -> voided" in said
    assert f"Order {settled.pk}: cannot void from settled" in said
    assert (phase(new), phase(settled)) == (Phase.VOIDED, Phase.SETTLED)
    results = dict(AuditEntry.objects.values_list("object_id", "result"))
    assert results == {str(new.pk): "applied", str(settled.pk): "not_allowed"}
    entry = AuditEntry.objects.get(object_id=str(new.pk))
    assert entry.target == "shop.order"
    # Idempotent: a second click finds it voided.
    assert shown(confirm(staff, "transition_void", new)) == [
        f"Order {new.pk}: already voided; nothing to do"
    ]
    assert Order.objects.get(pk=new.pk).version == 1


def test_void_needs_the_transition_permission(make_order) -> None:
    user = get_user_model().objects.create_user("clerk", password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="shop", codename__in=["view_order", "change_order"]
        )
    )
    client = Client()
    client.force_login(user)
    order = make_order()
    assert shown(confirm(client, "transition_void", order)) == [
        f"Order {order.pk}: you may not void it"
    ]
    assert phase(order) == Phase.NEW
    assert AuditEntry.objects.get().result == "forbidden"

    user.user_permissions.add(
        Permission.objects.get(content_type__app_label="shop", codename="delete_order")
    )
    client.force_login(get_user_model().objects.get(pk=user.pk))
    assert shown(confirm(client, "transition_void", order)) == [f"Order {order.pk}: new -> voided"]
    assert phase(order) == Phase.VOIDED


def test_settle_names_the_condition_a_blocked_order_fails(staff, make_order) -> None:
    blocked = make_order(blocked=True)
    said = shown(confirm(staff, "transition_settle", blocked))
    assert said == [f"Order {blocked.pk}: cannot settle: condition not_blocked does not hold"]
    assert phase(blocked) == Phase.NEW
    assert AuditEntry.objects.get().result == "not_allowed"


def test_settle_without_a_payment_message_is_refused(staff, make_order) -> None:
    order = make_order()
    said = shown(confirm(staff, "transition_settle", order))
    assert len(said) == 1
    assert "no payment.succeeded message" in said[0]
    assert phase(order) == Phase.NEW


def needs_reason(order: Any, payload: Any) -> dict[str, Any]:
    if not payload.get("reason"):
        raise InvalidMessage("payload.reason is required")
    return {}


def test_pick_is_leased_and_hold_applies_only_a_refused_message(staff, make_order) -> None:
    order = make_order()
    consume_message(payment(order), consumer="payments")
    # `pick` is the fulfilment step: the warehouse is asked once.
    said = shown(confirm(staff, "transition_pick", order))
    assert said[0].startswith(f"Order {order.pk}: settled -> picking")
    assert warehouse.effects(order.pk) == 1
    row = ProcessedMessage.objects.get(message_id=fulfilment_message_id(order.pk))
    assert row.status == InboxStatus.DONE

    # `hold` is the warehouse's to say: without its message the admin refuses.
    said = shown(confirm(staff, "transition_hold", order))
    assert len(said) == 1
    assert "no warehouse.held message for it in the inbox" in said[0]
    assert phase(order) == Phase.PICKING

    held = {"message_id": f"h-{order.pk}", "type": "warehouse.held", "order_id": order.pk}
    registry.register(
        "warehouse.held", transition="hold", validate=needs_reason, consumers={"shipping"}
    )
    try:
        assert consume_message(held, consumer="shipping") is Outcome.REJECTED
        said = shown(confirm(staff, "transition_hold", order))
        assert (
            f"warehouse.held h-{order.pk} is still refused: payload.reason is required" in (said[0])
        )
        assert phase(order) == Phase.PICKING
    finally:  # the validator is relaxed: the refused message is acceptable now
        registry.register("warehouse.held", transition="hold", consumers={"shipping"})
    said = shown(confirm(staff, "transition_hold", order))
    assert said == [f"Order {order.pk}: picking -> on hold"]
    assert phase(order) == Phase.ON_HOLD
    entry = AuditEntry.objects.get(action="transition:hold", result="applied")
    assert f"shipping:h-{order.pk}" in entry.detail


# -- deletion -----------------------------------------------------------------------------------


def test_orders_messages_refer_to_cannot_be_deleted(staff, make_order) -> None:
    settled = make_order()
    consume_message(payment(settled), consumer="payments")
    parked = make_order()
    consume_message(shipment(parked, "delivered"), consumer="shipping")  # parked: not sent yet
    for order in (settled, parked):
        assert staff.post(url("delete", order.pk), {"post": "yes"}).status_code == 403
    staff.post(
        url("changelist"),
        {
            "action": "delete_selected",
            "_selected_action": [settled.pk, parked.pk],
            "post": "yes",
        },
    )
    assert Order.objects.filter(pk__in=[settled.pk, parked.pk]).count() == 2
    assert ParkedMessage.objects.get(order=parked).order_id == parked.pk

    mistake = make_order()
    assert staff.post(url("delete", mistake.pk), {"post": "yes"}).status_code == 302
    assert not Order.objects.filter(pk=mistake.pk).exists()


# -- the dashboard and the evidence lists -------------------------------------------------------


def test_dashboard_counts_and_inbox_links_to_the_shop_order(staff, make_order) -> None:
    order = make_order()
    now = timezone.now()
    for n, status, lease in [
        (1, InboxStatus.PROCESSING, now - timedelta(hours=1)),
        (2, InboxStatus.PROCESSING, now - timedelta(hours=2)),
        (3, InboxStatus.PROCESSING, now + timedelta(hours=1)),  # a live lease: not stuck
        (4, InboxStatus.FAILED, None),
    ]:
        ProcessedMessage.objects.create(
            consumer="fulfilment",
            message_id=f"m-{n}",
            status=status,
            order=order,
            lease_expires_at=lease,
        )
    consume_message({"message_id": "bad-1", "type": "nope"}, consumer="payments")

    page = staff.get(reverse("admin:app_list", args=["idempotent_orders"]))
    assert page.status_code == 200
    html = page.content.decode()
    counts = dict(
        re.findall(r'<tr id="attention-(\w+)".*?<td class="count"><a [^>]*>(\d+)<', html, re.S)
    )
    assert counts["stuck"] == "2"
    assert counts["failed"] == "1"
    assert counts["rejected_today"] == "1"
    assert counts["overdue"] == "0"

    listed = staff.get(reverse("admin:idempotent_orders_processedmessage_changelist"))
    assert listed.status_code == 200
    assert f'href="{url("change", order.pk)}"' in listed.content.decode()
    assert staff.get(url("change", order.pk)).status_code == 200
