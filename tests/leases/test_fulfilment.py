"""Fulfilment as leased work against the fake warehouse, and the reconciler's decisions."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from demo_project import warehouse
from demo_project.models import WarehouseRequest
from idempotent_orders import reconcile
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.fulfilment import Verifier, fulfil, fulfilment_message_id
from idempotent_orders.leases import Lease, StepResult, Verification
from idempotent_orders.models import InboxStatus, Order, OrderStatus, Outcome, ProcessedMessage
from idempotent_orders.signals import lease_finished, message_reconciled
from tests.support.messages import payment, shipment
from tests.support.overrides import settings_with

pytestmark = pytest.mark.django_db
S = OrderStatus


@pytest.fixture
def paid(make_order) -> Order:
    order = make_order()
    assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    return Order.objects.get(pk=order.pk)


def row(order: Order) -> ProcessedMessage:
    return ProcessedMessage.objects.get(
        consumer="fulfilment", message_id=fulfilment_message_id(order.pk)
    )


def calls(order: Order) -> int:
    return WarehouseRequest.objects.filter(order_id=order.pk).count()


def test_fulfil_calls_the_warehouse_once_and_moves_to_processing(paid) -> None:
    assert fulfil(paid.pk) is Outcome.APPLIED
    assert fulfil(paid.pk) is Outcome.DUPLICATE
    order = Order.objects.get(pk=paid.pk)
    assert (order.status, order.version) == (S.PROCESSING, 2)
    r = row(order)
    assert (r.status, r.outcome, r.fencing_token, r.lease_expires_at) == (
        InboxStatus.DONE,
        Outcome.APPLIED,
        1,
        None,
    )
    assert warehouse.effects(order.pk) == calls(order) == 1
    key = WarehouseRequest.objects.get(order_id=order.pk).idempotency_key
    assert key.startswith("io1-")


@pytest.mark.parametrize(
    ("prepare", "outcome"),
    [
        (lambda order: None, Outcome.REJECTED),  # still pending payment
        ("ship", Outcome.STALE),
    ],
)
def test_fulfil_without_work_records_why(make_order, prepare, outcome) -> None:
    order = make_order()
    if prepare == "ship":
        consume_message(payment(order), consumer="payments")
        consume_message(shipment(order), consumer="shipping")
    assert fulfil(order.pk) is outcome
    assert row(order).outcome == outcome
    assert calls(order) == 0
    assert fulfil(10**9) is Outcome.REJECTED


def test_refused_call_is_retried_by_the_reconciler(paid) -> None:
    warehouse.script(paid.pk, "fail")
    assert fulfil(paid.pk) is StepResult.RETRY
    r = row(paid)
    assert r.status == InboxStatus.PROCESSING
    assert "refused" in r.error
    assert Order.objects.get(pk=paid.pk).status == S.PAID

    report = reconcile.reconcile()
    assert report.actions == {"completed": 1}
    assert Order.objects.get(pk=paid.pk).status == S.PROCESSING
    assert (calls(paid), warehouse.effects(paid.pk)) == (2, 1)
    assert reconcile.reconcile().actions == {}


def test_lost_reply_is_verified_and_completed_without_a_second_call(paid) -> None:
    warehouse.script(paid.pk, "lose_reply")
    assert fulfil(paid.pk) is StepResult.RETRY
    seen: list[str] = []

    def on_reconciled(sender, action, **kwargs) -> None:
        seen.append(action)

    message_reconciled.connect(on_reconciled)
    try:
        assert reconcile.reconcile().actions == {"completed": 1}
    finally:
        message_reconciled.disconnect(on_reconciled)
    assert seen == ["completed"]
    assert Order.objects.get(pk=paid.pk).status == S.PROCESSING
    assert (calls(paid), warehouse.effects(paid.pk)) == (1, 1)
    assert row(paid).attempts == 2


def test_after_max_stalls_the_row_is_failed_for_an_operator(paid) -> None:
    warehouse.script(paid.pk, "fail", "fail", "fail", "fail")
    with settings_with(RECONCILE_MAX_STALLS=2):
        assert fulfil(paid.pk) is StepResult.RETRY
        assert reconcile.reconcile().actions == {"retry": 1}
        assert reconcile.reconcile().actions == {"retry": 1}
        assert reconcile.reconcile().actions == {"failed": 1}
        assert reconcile.reconcile().actions == {}
    r = row(paid)
    assert r.status == InboxStatus.FAILED
    # Refused three times: said as such, with the warehouse's last answer, not "stalled".
    assert r.error.startswith("gave up after 3 attempts that did not finish; last: ")
    assert "stall" not in r.error
    assert calls(paid) == 3
    assert warehouse.effects(paid.pk) == 0
    assert fulfil(paid.pk) is StepResult.FAILED


def test_order_shipped_meanwhile_completes_as_stale(paid) -> None:
    warehouse.script(paid.pk, "lose_reply")
    assert fulfil(paid.pk) is StepResult.RETRY
    consume_message(shipment(paid), consumer="shipping")
    assert reconcile.reconcile().actions == {"completed": 1}
    r = row(paid)
    assert (r.status, r.outcome) == (InboxStatus.DONE, Outcome.STALE)
    assert Order.objects.get(pk=paid.pk).status == S.SHIPPED


def test_order_refunded_meanwhile_is_failed_with_a_reason(paid) -> None:
    warehouse.script(paid.pk, "lose_reply")
    assert fulfil(paid.pk) is StepResult.RETRY
    refund = payment(paid, message_id=f"refund-{paid.pk}")
    refund["type"] = "payment.refunded"
    assert consume_message(refund, consumer="payments") is Outcome.APPLIED
    assert reconcile.reconcile().actions == {"failed": 1}
    r = row(paid)
    assert r.status == InboxStatus.FAILED
    assert "refunded" in r.error


class UnknownVerifier(Verifier):
    def verify(self, lease: Lease) -> Verification:
        return Verification.UNKNOWN


def test_unknown_verdict_is_a_stall_without_a_call(paid) -> None:
    warehouse.script(paid.pk, "fail")
    assert fulfil(paid.pk) is StepResult.RETRY
    with settings_with(FULFILMENT_VERIFIER="tests.leases.test_fulfilment.UnknownVerifier"):
        assert reconcile.reconcile().actions == {"retry": 1}
    assert calls(paid) == 1
    assert row(paid).error == "the effect could not be verified"


def test_live_leases_are_left_alone(paid) -> None:
    warehouse.script(paid.pk, "fail")
    assert fulfil(paid.pk) is StepResult.RETRY
    ProcessedMessage.objects.filter(pk=row(paid).pk).update(
        lease_expires_at=timezone.now() + timedelta(minutes=5)
    )
    assert reconcile.reconcile().actions == {}
    assert fulfil(paid.pk) is Outcome.DUPLICATE  # the holder, not a redelivery, finishes it


def test_command_runs_a_pass(paid, capsys) -> None:
    warehouse.script(paid.pk, "fail")
    fulfil(paid.pk)
    results: list[str] = []

    def on_lease(sender, result, via, **kwargs) -> None:
        results.append(f"{via}:{result}")

    lease_finished.connect(on_lease)
    try:
        call_command("reconcile_orders", "--until-empty")
    finally:
        lease_finished.disconnect(on_lease)
    assert "completed=1" in capsys.readouterr().out
    assert results == ["reconciler:completed"]
