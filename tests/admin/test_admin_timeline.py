"""The operator's admin: one timeline per order, what needs attention on /admin/, every action
confirmed, said and audited with its order and message."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.checks import run_checks
from django.urls import reverse
from django.utils import timezone
from django_fsm.signals import post_transition

from demo_project import warehouse
from idempotent_orders import get_order_model
from idempotent_orders.consuming.decision import REFUND
from idempotent_orders.consuming.failures import MessageFailed
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.fulfilment import fulfil, fulfilment_message_id
from idempotent_orders.models import (
    AuditEntry,
    InboxStatus,
    OutboxMessage,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.reconcile import give_up_reason
from idempotent_orders.timeline import timeline
from tests.support.admin import left, shown
from tests.support.messages import payment, shipment

pytestmark = pytest.mark.django_db

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def order_url(order: Any) -> str:
    return reverse("admin:idempotent_orders_order_change", args=[order.pk])


def confirm_url(row: ProcessedMessage, verb: str) -> str:
    return reverse("admin:idempotent_orders_processedmessage_confirm", args=[row.pk, verb])


class Broken:
    def __init__(self) -> None:
        self.broken = True

    def __call__(self, sender: Any, instance: Any, name: str, **kwargs: Any) -> None:
        if self.broken and name == "pay":
            raise ZeroDivisionError("a bug in a receiver")


def journey(make_order: Any) -> tuple[Any, dict[str, Any]]:
    """An order through a park, a failed payment delivered twice, its retry by an operator
    (through the admin's one-row page), and a follow-up in the outbox."""
    order = make_order()
    ship = shipment(order, seq=2, message_id="ship-2")
    pay = payment(order, seq=1, message_id="pay-1")
    assert consume_message(ship, consumer="shipping") == "parked"
    broken = Broken()
    post_transition.connect(broken, sender=get_order_model(), weak=False)
    try:
        for _ in (1, 2):  # the broker delivers it again: still failing
            with pytest.raises(MessageFailed):
                consume_message(pay, consumer="payments")
    finally:
        post_transition.disconnect(broken, sender=get_order_model())
    OutboxMessage.objects.create(
        message_id=f"points-{order.pk}",
        task_name="demo.award_points",
        payload={},
        order_key=str(order.pk),
        traceparent=TRACE,
    )
    return order, {"pay": pay, "ship": ship}


def test_the_timeline_tells_the_story_of_an_order(staff: Any, make_order: Any) -> None:
    order, _ = journey(make_order)
    page = staff.get(order_url(order)).content.decode()
    assert 'id="timeline"' in page
    # Before the fix: the payment failed twice; the shipment is held, with why (now).
    failed = ProcessedMessage.objects.get(message_id="pay-1")
    assert failed.status == InboxStatus.FAILED
    assert "handled 2 times; failed: ZeroDivisionError(&#x27;a bug in a receiver&#x27;)" in page
    assert "held since" in page
    assert "waiting for seq 1 (the order is at seq 0)" in page
    assert TRACE.split("-")[1] in page  # the trace id
    # The one-row page the timeline links to: confirmation first, nothing done yet.
    link = confirm_url(failed, "retry")
    assert link in page
    ask = staff.get(link + f"?next={order_url(order)}")
    assert "are you sure?" in ask.content.decode()
    assert "consumes the message again from the envelope" in ask.content.decode()
    assert ProcessedMessage.objects.get(pk=failed.pk).status == InboxStatus.FAILED
    done = staff.post(link, {"post": "yes", "next": order_url(order)}, follow=True)
    assert done.redirect_chain[-1][0] == order_url(order)
    assert shown(done) == [
        f"Retry (verifies first) payments:pay-1 (order {order.pk}): applied; now applied."
    ]
    assert left(done) == ["Nothing else needs attention now."]
    entry = AuditEntry.objects.get(action="retry")
    assert (entry.order_pk, entry.message_id, entry.result) == (str(order.pk), "pay-1", "applied")

    # After: both applied (the shipment was released), the retry is in the story, in order.
    events = timeline(get_order_model()._default_manager.get(pk=order.pk))
    kinds = [(e.kind, e.outcome) for e in events]
    assert kinds[0] == ("order", "")
    assert ("message", "applied") in kinds
    assert ("operator", "applied") in kinds
    assert ("outbox", "pending") in kinds
    assert [e.at for e in events] == sorted(e.at for e in events)
    assert not ParkedMessage.objects.exists()
    text = staff.get(order_url(order)).content.decode()
    assert "ran pay" in text
    assert "ran ship" in text
    assert re.search(r"\d\d:\d\d:\d\d", text)  # seconds


def test_a_held_message_says_why_it_waits_now_not_when_parked(staff, make_order) -> None:
    order = make_order()
    consume_message(shipment(order, seq=3, message_id="ship-3"), consumer="shipping")
    parked = ParkedMessage.objects.get()
    assert parked.reason == "waiting for seq 1"
    listing = staff.get(reverse("admin:idempotent_orders_parkedmessage_changelist"))
    assert "waiting for seq 1 (the order is at seq 0)" in listing.content.decode()
    # The order moved on (seq 1 applied) while the stored text stays as it was.
    consume_message(payment(order, seq=1), consumer="payments")
    assert ParkedMessage.objects.get().reason == "waiting for seq 1"
    listing = staff.get(reverse("admin:idempotent_orders_parkedmessage_changelist"))
    assert "waiting for seq 2 (the order is at seq 1)" in listing.content.decode()


def test_admin_index_shows_what_needs_attention(staff, make_order, settings) -> None:
    settings.IDEMPOTENT_ORDERS = {**settings.IDEMPOTENT_ORDERS, "PARKED_ATTENTION_AFTER": 120}
    order = make_order()
    consume_message(shipment(order, seq=2, message_id="ship-2"), consumer="shipping")
    ParkedMessage.objects.update(parked_at=timezone.now() - timedelta(minutes=3))
    ProcessedMessage.objects.create(
        consumer="payments",
        message_id="late-pay",
        status=InboxStatus.REJECTED,
        outcome="rejected",
        order=order,
        error=f"order has moved past this step (now cancelled); {REFUND}",
    )
    html = staff.get("/admin/").content.decode()
    assert 'id="attention"' in html
    for key, count in {"held": 1, "refund": 1, "stuck": 0, "failed": 0, "inbox_dead": 0}.items():
        row = re.search(rf'<tr id="attention-{key}".*?</tr>', html, re.S)
        assert row is not None, key
        link = re.search(r'<td class="count"><a href="([^"]+)">(\d+)</a>', row.group(0))
        assert link is not None, key
        assert int(link.group(2)) == count, key
        listed = staff.get(link.group(1).replace("&amp;", "&"))
        assert len(listed.context["cl"].result_list) == count, key
    assert "Held longer than 2 minutes" in html
    # The inbox list: the order is a link, the reason is wrapped.
    listing = staff.get(reverse("admin:idempotent_orders_processedmessage_changelist"))
    assert f'href="{order_url(order)}"' in listing.content.decode()
    assert '<div class="io-reason">order has moved past this step' in listing.content.decode()


def test_a_stuck_row_is_fixed_from_its_one_row_page(staff, make_order) -> None:
    order = make_order()
    consume_message(payment(order), consumer="payments")
    warehouse.script(order.pk, "lose_reply")
    fulfil(order.pk)
    row = ProcessedMessage.objects.get(message_id=fulfilment_message_id(order.pk))
    listing = staff.get(
        reverse("admin:idempotent_orders_processedmessage_changelist") + "?attention=refused"
    )
    assert confirm_url(row, "retry") in listing.content.decode()
    page = staff.get(confirm_url(row, "retry"))
    assert "asks fulfilment first whether it already happened" in page.content.decode()
    done = staff.post(confirm_url(row, "retry"), {"post": "yes"}, follow=True)
    assert "completed; now applied." in shown(done)[0]
    assert warehouse.effects(order.pk) == 1
    # The order's timeline keeps the lost reply and the verified completion after the fix.
    attempts = [(e.outcome, e.text) for e in timeline(order) if e.kind == "attempt"]
    assert attempts == [
        ("refused", "WarehouseError: connection reset while reading the reply"),
        ("completed", "verified: the effect had happened"),
    ]
    # The audit trail is searchable by the order and by the message id.
    audit = reverse("admin:idempotent_orders_auditentry_changelist")
    for q in (str(order.pk), row.message_id):
        found = staff.get(audit, {"q": q}).context["cl"].result_list
        assert [e.action for e in found] == ["retry"], q


def test_a_refused_step_given_up_twice_reads_once() -> None:
    first = give_up_reason(3, "WarehouseError: the warehouse refused the request")
    again = give_up_reason(4, first)
    assert again == (
        "gave up after 4 attempts that did not finish; "
        "last: WarehouseError: the warehouse refused the request"
    )
    assert "stall" in give_up_reason(2, "")


def test_held_attention_longer_than_the_timeout_is_a_warning(settings) -> None:
    settings.IDEMPOTENT_ORDERS = {
        **settings.IDEMPOTENT_ORDERS,
        "PARKED_ATTENTION_AFTER": 7200,
        "PARKED_TIMEOUT": 3600,
    }
    assert "idempotent_orders.W037" in {m.id for m in run_checks()}
    settings.IDEMPOTENT_ORDERS = {**settings.IDEMPOTENT_ORDERS, "PARKED_ATTENTION_AFTER": 0}
    assert "idempotent_orders.E036" in {m.id for m in run_checks()}


def test_four_refusals_stay_in_the_timeline_after_the_fix(make_order) -> None:
    from idempotent_orders import reconcile
    from idempotent_orders.admin import attention

    order = make_order()
    consume_message(payment(order), consumer="payments")
    warehouse.script(order.pk, "fail", "fail", "fail", "fail")
    fulfil(order.pk)
    row = ProcessedMessage.objects.get(message_id=fulfilment_message_id(order.pk))
    operator = get_user_model().objects.create_superuser("op4", "op4@example.com", "pw")
    counts = {line.key: line.count for line in attention(operator)}
    assert (counts["refused"], counts["stuck"]) == (1, 0)  # refused: no worker stalled
    outcomes = {e.kind: e.outcome for e in timeline(order) if e.kind == "lease"}
    assert outcomes == {"lease": "refused"}
    for _ in range(3):
        assert reconcile.retry(row.pk).value == "retry"
    assert reconcile.retry(row.pk).value == "completed"
    attempts = [(e.outcome, e.who) for e in timeline(order) if e.kind == "attempt"]
    assert attempts == [("refused", "worker")] + [("refused", "admin")] * 3 + [
        ("completed", "admin")
    ]
    assert all(
        e.text == "WarehouseError: the warehouse refused the request"
        for e in timeline(order)
        if e.outcome == "refused"
    )
