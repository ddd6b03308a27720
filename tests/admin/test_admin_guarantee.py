"""The admin cannot break the guarantee: no lost updates, no deleted evidence, confirmed actions."""

from __future__ import annotations

import json
import threading
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection
from django.db.models import F
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from demo_project import warehouse
from idempotent_orders import tasks
from idempotent_orders.admin.orders import OrderChangeForm
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.fulfilment import fulfilment_message_id
from idempotent_orders.idempotent import idempotent
from idempotent_orders.models import (
    AuditEntry,
    IdempotencyKey,
    InboxStatus,
    KeyState,
    Order,
    OrderStatus,
    OutboxMessage,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)
from tests.support.admin import form_data, shown
from tests.support.messages import payment, shipment
from tests.support.services import wait_until

pytestmark = pytest.mark.django_db
S = OrderStatus


def url(model: str, view: str, *args: Any) -> str:
    return reverse(f"admin:idempotent_orders_{model}_{view}", args=args)


def action_choices(page: Any) -> dict[str, str]:
    """The changelist's actions by name, with their labels (none: no action menu at all)."""
    action_form = page.context["action_form"]
    if action_form is None:
        return {}
    return {name: str(label) for name, label in action_form.fields["action"].choices}


# -- 5. the order form never overwrites what messages wrote ---------------------------------


def test_stale_order_form_overwrites_nothing_and_names_what_changed(staff, make_order) -> None:
    order = make_order()
    change = url("order", "change", order.pk)
    page = staff.get(change)
    assert page.status_code == 200
    data = form_data(page)
    data["amount"] = "99.00"

    # A worker applies the payment while the operator looks at the form.
    assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    response = staff.post(change, data)

    assert response.status_code == 200, "a stale save must be refused, not redirected"
    errors = " ".join(response.context["adminform"].form.non_field_errors())
    assert "payment_id" in errors
    assert "status" in errors
    fresh = Order.objects.get(pk=order.pk)
    assert fresh.payment_id == f"pay-{order.pk}"
    assert fresh.status == S.PAID
    assert fresh.version == 1
    assert fresh.amount == Decimal("12.50")


def test_fresh_order_form_saves_with_a_version_bump(staff, make_order) -> None:
    order = make_order()
    change = url("order", "change", order.pk)
    data = form_data(staff.get(change))
    data["amount"] = "13.00"
    response = staff.post(change, data)
    assert response.status_code == 302
    fresh = Order.objects.get(pk=order.pk)
    assert fresh.amount == Decimal("13.00")
    assert fresh.version == 1
    assert fresh.status == S.PENDING_PAYMENT


def test_order_form_save_is_conditional_on_the_version(staff, make_order, monkeypatch) -> None:
    """A write landing between the form's check and its UPDATE still makes the save refuse."""
    order = make_order()
    change = url("order", "change", order.pk)
    data = form_data(staff.get(change))
    data["amount"] = "13.00"
    checked = OrderChangeForm.clean

    def racing(form: Any) -> Any:
        cleaned = checked(form)
        Order.objects.filter(pk=order.pk).update(version=F("version") + 1, payment_id="pay-x")
        return cleaned

    monkeypatch.setattr(OrderChangeForm, "clean", racing)
    response = staff.post(change, data, follow=True)
    assert any("changed" in m and "Nothing was saved" in m for m in shown(response))
    assert Order.objects.get(pk=order.pk).amount == Decimal("12.50")


def lock_waiters() -> int:
    """Sessions of this database blocked on a row lock right now."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        else:
            cursor.execute(
                "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
            )
        return int(cursor.fetchone()[0])


@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db(transaction=True)
def test_a_message_arriving_during_a_save_waits_and_both_land(staff, make_order, monkeypatch):
    """The form locks the order from its check to its UPDATE: a payment then applies after it."""
    order = make_order()
    buyer = get_user_model().objects.create_user("buyer", password="pw")
    change = url("order", "change", order.pk)
    data = form_data(staff.get(change))
    data["customer"] = str(buyer.pk)
    checked = OrderChangeForm.clean
    locked, release = threading.Event(), threading.Event()

    def holding(form: Any) -> Any:
        cleaned = checked(form)
        locked.set()
        release.wait(30)
        return cleaned

    monkeypatch.setattr(OrderChangeForm, "clean", holding)
    results: dict[str, Any] = {}

    def in_thread(name: str, call: Any) -> threading.Thread:
        def run() -> None:
            try:
                results[name] = call()
            finally:
                connection.close()

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    saving = in_thread("save", lambda: staff.post(change, data).status_code)
    assert locked.wait(30)
    paying = in_thread("pay", lambda: consume_message(payment(order), consumer="payments"))
    try:
        assert wait_until(lambda: lock_waiters() > 0, timeout=30), "the payment did not wait"
    finally:
        release.set()
        saving.join(30)
        paying.join(30)
    assert results == {"save": 302, "pay": Outcome.APPLIED}
    fresh = Order.objects.get(pk=order.pk)
    assert (fresh.customer_id, fresh.status, fresh.payment_id) == (
        buyer.pk,
        S.PAID,
        f"pay-{order.pk}",
    )
    assert fresh.version == 2  # the save, then the payment: each bumped it once


def test_message_owned_fields_are_read_only(staff, make_order) -> None:
    order = make_order()
    form = staff.get(url("order", "change", order.pk)).context["adminform"].form
    owned = {"status", "version", "payment_id", "tracking_number", "carrier", "last_seq"}
    owned |= {"has_parked", "business_key"}
    assert not owned & set(form.fields)
    consume_message(payment(order), consumer="payments")
    form = staff.get(url("order", "change", order.pk)).context["adminform"].form
    # Paid: the amount and currency the payment was checked against are fixed too.
    assert not {"amount", "currency"} & set(form.fields)


def test_orders_can_still_be_added(staff) -> None:
    response = staff.post(
        url("order", "add"), {"business_key": "by-hand-1", "amount": "5.00", "currency": "CNY"}
    )
    assert response.status_code == 302
    order = Order.objects.get(business_key="by-hand-1")
    assert (order.status, order.version, order.amount) == (S.PENDING_PAYMENT, 0, Decimal("5.00"))


# -- 6. inbox, parked, outbox and key rows are never added or deleted -------------------------


def _rows(make_order: Any) -> dict[str, Any]:
    order = make_order()
    consume_message(payment(order, seq=2), consumer="payments")  # parked, with its inbox row
    now = timezone.now()
    return {
        "processedmessage": ProcessedMessage.objects.get(order=order),
        "parkedmessage": ParkedMessage.objects.get(order=order),
        "outboxmessage": OutboxMessage.objects.create(
            message_id="out-1", task_name="demo.award", payload={}
        ),
        "idempotencykey": IdempotencyKey.objects.create(
            scope="s" * 64,
            key="k-1",
            principal="user:1",
            state=KeyState.COMPLETED,
            expires_at=now,
        ),
    }


@pytest.mark.parametrize(
    "model", ["processedmessage", "parkedmessage", "outboxmessage", "idempotencykey"]
)
def test_evidence_rows_cannot_be_added_or_deleted(staff, make_order, model) -> None:
    row = _rows(make_order)[model]
    assert staff.get(url(model, "add")).status_code == 403
    assert staff.post(url(model, "delete", row.pk), {"post": "yes"}).status_code == 403
    assert "delete_selected" not in action_choices(staff.get(url(model, "changelist")))
    staff.post(
        url(model, "changelist"),
        {"action": "delete_selected", "_selected_action": [row.pk], "post": "yes"},
    )
    assert type(row).objects.filter(pk=row.pk).exists()


def test_outbox_rows_cannot_be_purged_from_the_admin(staff) -> None:
    row = OutboxMessage.objects.create(
        message_id="out-1", task_name="demo.award", payload={}, status="sent"
    )
    assert "purge_sent" not in action_choices(staff.get(url("outboxmessage", "changelist")))
    staff.post(
        url("outboxmessage", "changelist"), {"action": "purge_sent", "_selected_action": [row.pk]}
    )
    assert OutboxMessage.objects.filter(pk=row.pk).exists()


@pytest.mark.parametrize("model", ["processedmessage", "parkedmessage", "idempotencykey"])
def test_evidence_rows_cannot_be_edited(staff, make_order, model) -> None:
    row = _rows(make_order)[model]
    page = staff.get(url(model, "change", row.pk))
    assert page.status_code == 200
    assert not page.context["adminform"].form.fields  # a view-only page
    staff.post(url(model, "change", row.pk), {"message_id": "renamed", "key": "renamed"})
    fresh = type(row).objects.get(pk=row.pk)
    assert getattr(fresh, "message_id", getattr(fresh, "key", None)) != "renamed"


noted: list[str] = []


@idempotent(key="message_id", consumer="test-admin")
def note(message: dict[str, Any]) -> None:
    noted.append(message["message_id"])


def test_inbox_actions_need_the_change_permission(make_order) -> None:
    order = make_order()
    consume_message(payment(order, seq=2), consumer="payments")
    row = ProcessedMessage.objects.get(order=order)
    viewer = get_user_model().objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_processedmessage"))
    client = Client()
    client.force_login(viewer)
    assert action_choices(client.get(url("processedmessage", "changelist"))) == {}
    client.post(
        url("processedmessage", "changelist"), {"action": "fail", "_selected_action": [row.pk]}
    )
    assert not AuditEntry.objects.exists()


def test_a_processed_message_keeps_its_duplicate_away(staff) -> None:
    noted.clear()
    note({"message_id": "once"})
    row = ProcessedMessage.objects.get(consumer="test-admin", message_id="once")
    staff.post(
        url("processedmessage", "changelist"),
        {"action": "delete_selected", "_selected_action": [row.pk], "post": "yes"},
    )
    staff.post(url("processedmessage", "delete", row.pk), {"post": "yes"})
    note({"message_id": "once"})
    assert noted == ["once"]


def test_orders_with_inbox_rows_cannot_be_deleted(staff, make_order) -> None:
    paid = make_order()
    consume_message(payment(paid), consumer="payments")
    assert staff.post(url("order", "delete", paid.pk), {"post": "yes"}).status_code == 403
    staff.post(
        url("order", "changelist"),
        {"action": "delete_selected", "_selected_action": [paid.pk], "post": "yes"},
    )
    assert Order.objects.filter(pk=paid.pk).exists()
    assert ProcessedMessage.objects.get(order=paid).order_id == paid.pk


def test_orders_no_message_touched_can_be_deleted(staff, make_order) -> None:
    mistake = make_order()
    response = staff.post(url("order", "delete", mistake.pk), {"post": "yes"})
    assert response.status_code == 302
    assert not Order.objects.filter(pk=mistake.pk).exists()


# -- 7. transition actions confirm first, honour the rules, report per order -------------------


def ask(client: Client, action: str, *orders: Order) -> Any:
    return client.post(
        url("order", "changelist"),
        {"action": action, "_selected_action": [str(o.pk) for o in orders]},
    )


def confirm(client: Client, action: str, *orders: Order) -> Any:
    data: dict[str, Any] = {
        "action": action,
        "_selected_action": [str(o.pk) for o in orders],
        "post": "yes",
    }
    for order in orders:
        data[f"version-{order.pk}"] = str(order.version)
    return client.post(url("order", "changelist"), data, follow=True)


def test_transition_actions_have_human_labels(staff) -> None:
    labels = action_choices(staff.get(url("order", "changelist")))
    assert labels["transition_ship"] == "Mark as shipped"
    assert labels["transition_cancel"] == "Mark as cancelled"
    assert "_" not in " ".join(str(label) for label in labels.values())


def test_transition_action_asks_for_confirmation_first(staff, make_order) -> None:
    pending, paid = make_order(), make_order()
    consume_message(payment(paid), consumer="payments")
    response = ask(staff, "transition_cancel", pending, paid)
    assert response.status_code == 200
    page = response.content.decode()
    assert "Are you sure" in page
    assert f"Order {pending.pk}" in page
    assert f"Order {paid.pk}" in page
    assert "pending payment -&gt; cancelled" in page
    assert "cannot cancel from paid" in page
    assert Order.objects.get(pk=pending.pk).status == S.PENDING_PAYMENT
    assert not AuditEntry.objects.exists()


def test_confirmed_action_reports_each_order_in_plain_words(staff, make_order) -> None:
    pending, paid = make_order(), make_order()
    consume_message(payment(paid), consumer="payments")
    paid.refresh_from_db()
    response = confirm(staff, "transition_cancel", pending, paid)
    said = shown(response)
    assert f"Order {pending.pk}: pending payment -> cancelled" in said
    assert f"Order {paid.pk}: cannot cancel from paid" in said
    assert Order.objects.get(pk=pending.pk).status == S.CANCELLED
    assert Order.objects.get(pk=paid.pk).status == S.PAID
    results = dict(AuditEntry.objects.values_list("object_id", "result"))
    assert results == {str(pending.pk): "applied", str(paid.pk): "not_allowed"}
    # Idempotent: confirming again does nothing and says so.
    said = shown(confirm(staff, "transition_cancel", pending))
    assert said == [f"Order {pending.pk}: already cancelled; nothing to do"]
    assert Order.objects.get(pk=pending.pk).version == 1


def test_confirmation_is_refused_when_the_order_moved_since(staff, make_order) -> None:
    order = make_order()
    Order.objects.filter(pk=order.pk).update(version=F("version") + 1, customer=None)
    said = shown(confirm(staff, "transition_cancel", order))  # confirms v0
    assert len(said) == 1
    assert "changed" in said[0]
    assert f"Order {order.pk}" in said[0]
    assert Order.objects.get(pk=order.pk).status == S.PENDING_PAYMENT


def test_pay_without_a_payment_record_is_refused(staff, make_order, monkeypatch, settings) -> None:
    settings.IDEMPOTENT_ORDERS = {**settings.IDEMPOTENT_ORDERS, "FULFIL_AFTER_PAYMENT": True}
    enqueued: list[Any] = []
    monkeypatch.setattr(tasks.fulfil_order, "apply_async", lambda *a, **k: enqueued.append(a))
    order = make_order()
    said = shown(confirm(staff, "transition_pay", order))
    assert len(said) == 1
    assert said[0].startswith(f"Order {order.pk}: ")
    assert "no payment" in said[0]
    assert Order.objects.get(pk=order.pk).status == S.PENDING_PAYMENT
    assert enqueued == []
    assert AuditEntry.objects.get().result == "refused"


def test_pay_applies_a_rejected_payment_once_its_reason_is_fixed(
    staff, make_order, monkeypatch, settings, django_capture_on_commit_callbacks
) -> None:
    settings.IDEMPOTENT_ORDERS = {**settings.IDEMPOTENT_ORDERS, "FULFIL_AFTER_PAYMENT": True}
    enqueued: list[Any] = []
    monkeypatch.setattr(tasks.fulfil_order, "apply_async", lambda *a, **k: enqueued.append(a))
    order = make_order(amount=Decimal("10.00"))
    # The customer was charged 12.50 but the order says 10.00: the payment is rejected.
    msg = payment(order, message_id="pay-mismatch", amount="12.50", payment_id="pay-777")
    assert consume_message(msg, consumer="payments") is Outcome.REJECTED
    said = shown(confirm(staff, "transition_pay", order))
    assert "does not match" in said[0]
    assert Order.objects.get(pk=order.pk).status == S.PENDING_PAYMENT

    Order.objects.filter(pk=order.pk).update(amount=Decimal("12.50"))  # the operator fixed it
    order.refresh_from_db()
    with django_capture_on_commit_callbacks(execute=True):
        said = shown(confirm(staff, "transition_pay", order))
    assert said == [f"Order {order.pk}: pending payment -> paid (payment pay-777)"]
    fresh = Order.objects.get(pk=order.pk)
    assert (fresh.status, fresh.payment_id) == (S.PAID, "pay-777")
    assert len(enqueued) == 1  # fulfilment follows a real payment
    entry = AuditEntry.objects.filter(result="applied").get()
    assert "pay-777" in entry.detail
    assert "pay-mismatch" in entry.detail
    said = shown(confirm(staff, "transition_pay", fresh))
    assert said == [f"Order {order.pk}: already paid; nothing to do"]


def test_start_processing_goes_through_leased_fulfilment(staff, make_order) -> None:
    order = make_order()
    consume_message(payment(order), consumer="payments")
    order.refresh_from_db()
    said = shown(confirm(staff, "transition_start_processing", order))
    assert said[0].startswith(f"Order {order.pk}: paid -> processing")
    row = ProcessedMessage.objects.get(message_id=fulfilment_message_id(order.pk))
    assert row.status == InboxStatus.DONE
    assert warehouse.effects(order.pk) == 1
    said = shown(confirm(staff, "transition_start_processing", Order.objects.get(pk=order.pk)))
    assert said == [f"Order {order.pk}: already processing; nothing to do"]
    assert warehouse.effects(order.pk) == 1


def test_start_processing_of_an_unpaid_order_leaves_no_inbox_row(staff, make_order) -> None:
    order = make_order()
    said = shown(confirm(staff, "transition_start_processing", order))
    assert said == [f"Order {order.pk}: cannot start processing from pending payment"]
    assert not ProcessedMessage.objects.exists()  # a later real fulfilment is not blocked


def test_ship_needs_a_shipment_message(staff, make_order) -> None:
    order = make_order()
    consume_message(payment(order), consumer="payments")
    order.refresh_from_db()
    said = shown(confirm(staff, "transition_ship", order))
    assert len(said) == 1
    assert "no shipment" in said[0]
    assert Order.objects.get(pk=order.pk).status == S.PAID
    consume_message(shipment(order), consumer="shipping")
    assert Order.objects.get(pk=order.pk).status == S.SHIPPED


def test_transition_permission_is_honoured(make_order, monkeypatch) -> None:
    meta = Order.cancel._django_fsm  # type: ignore[attr-defined]
    monkeypatch.setattr(
        meta.transitions[S.PENDING_PAYMENT], "permission", "idempotent_orders.cancel_orders"
    )
    user = get_user_model().objects.create_user("clerk", password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_order", "change_order"])
    )
    client = Client()
    client.force_login(user)
    order = make_order()
    said = shown(confirm(client, "transition_cancel", order))
    assert said == [f"Order {order.pk}: you may not cancel it"]
    assert Order.objects.get(pk=order.pk).status == S.PENDING_PAYMENT
    assert AuditEntry.objects.get().result == "forbidden"


def test_transition_conditions_are_honoured(staff, make_order, monkeypatch) -> None:
    meta = Order.cancel._django_fsm  # type: ignore[attr-defined]

    def not_locked(order: Order) -> bool:
        return False

    monkeypatch.setattr(meta.transitions[S.PENDING_PAYMENT], "conditions", [not_locked])
    order = make_order()
    said = shown(confirm(staff, "transition_cancel", order))
    assert said == [f"Order {order.pk}: cannot cancel: condition not_locked does not hold"]
    assert Order.objects.get(pk=order.pk).status == S.PENDING_PAYMENT


def test_rejected_payment_body_is_what_pay_reads(make_order) -> None:
    """The replay reads the inbox row's stored body; keep that body a JSON envelope."""
    order = make_order(amount=Decimal("10.00"))
    consume_message(payment(order, message_id="m", amount="12.50"), consumer="payments")
    body = json.loads(ProcessedMessage.objects.get(message_id="m").body)
    assert body["payload"]["payment_id"] == f"pay-{order.pk}"


# -- 7. every action: the change permission, an audit entry, and a second click does nothing --


ADMIN_MODELS = [
    "order",
    "processedmessage",
    "parkedmessage",
    "outboxmessage",
    "idempotencykey",
    "auditentry",
]


def _viewer() -> Client:
    user = get_user_model().objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=[f"view_{m}" for m in ADMIN_MODELS])
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.parametrize("model", ADMIN_MODELS)
def test_a_viewer_is_offered_no_action(make_order, model) -> None:
    _rows(make_order)
    page = _viewer().get(url(model, "changelist"))
    assert page.status_code == 200
    assert set(action_choices(page)) <= {""}, model


def test_publish_again_is_refused_to_a_viewer(make_order) -> None:
    # It once ran for anyone who could see the changelist, and was never audited.
    row = OutboxMessage.objects.create(
        message_id="out-v", task_name="demo.award", payload={}, status="sent"
    )
    _viewer().post(
        url("outboxmessage", "changelist"),
        {"action": "publish_again", "_selected_action": [row.pk]},
    )
    assert OutboxMessage.objects.get(pk=row.pk).status == "sent"
    assert not AuditEntry.objects.exists()


def test_publish_again_is_audited_and_a_second_click_does_nothing_more(staff) -> None:
    sent = OutboxMessage.objects.create(
        message_id="out-s", task_name="demo.award", payload={}, status="sent"
    )
    dead = OutboxMessage.objects.create(
        message_id="out-d", task_name="demo.award", payload={}, status="dead"
    )
    post = {"action": "publish_again", "_selected_action": [sent.pk, dead.pk]}
    first = staff.post(url("outboxmessage", "changelist"), post, follow=True)
    assert OutboxMessage.objects.get(pk=sent.pk).status == "pending"
    assert OutboxMessage.objects.get(pk=dead.pk).status == "dead"
    assert any("1 queued" in m for m in shown(first)), shown(first)
    entries = {
        (e.object_id, e.result) for e in AuditEntry.objects.filter(action="outbox:publish_again")
    }
    assert entries == {(str(sent.pk), "queued"), (str(dead.pk), "skipped")}

    queued = OutboxMessage.objects.get(pk=sent.pk)
    second = staff.post(url("outboxmessage", "changelist"), post, follow=True)
    again = OutboxMessage.objects.get(pk=sent.pk)
    assert (again.status, again.available_at, again.attempts) == (
        "pending",
        queued.available_at,
        queued.attempts,
    )
    assert any("nothing more" in m for m in shown(second)), shown(second)
    assert AuditEntry.objects.filter(action="outbox:publish_again", result="queued").count() == 1
    assert AuditEntry.objects.filter(action="outbox:publish_again", result="skipped").count() == 3


def test_deleting_orders_is_audited_and_a_second_click_does_nothing_more(staff, make_order) -> None:
    order = make_order()
    post = {"action": "delete_selected", "_selected_action": [order.pk], "post": "yes"}
    staff.post(url("order", "changelist"), post)
    assert not Order.objects.filter(pk=order.pk).exists()
    entry = AuditEntry.objects.get(action="order:delete")
    assert (entry.object_id, entry.result) == (str(order.pk), "deleted")
    staff.post(url("order", "changelist"), post)
    assert AuditEntry.objects.filter(action="order:delete").count() == 1
