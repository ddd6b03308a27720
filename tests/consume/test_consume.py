"""consume_message: every outcome, sequencing, parking and release, follow-ups after commit."""

from __future__ import annotations

from typing import Any

import pytest

from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import (
    InboxStatus,
    Order,
    OrderStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.signals import message_consumed, order_transitioned
from tests.support.messages import payment, shipment
from tests.support.metrics import messages_decided, outcome_counts

pytestmark = pytest.mark.django_db
S = OrderStatus


def status(order: Order) -> tuple[str, int, int]:
    row = Order.objects.get(pk=order.pk)
    return row.status, row.version, row.last_seq


def test_outcome_values_are_the_public_strings() -> None:
    assert [o.value for o in Outcome] == [
        "applied",
        "duplicate",
        "stale",
        "parked",
        "rejected",
        "failed",
    ]


def test_applied_then_exact_duplicate(make_order) -> None:
    order = make_order()
    msg = payment(order)
    assert consume_message(msg, consumer="payments") is Outcome.APPLIED
    assert consume_message(msg, consumer="payments") is Outcome.DUPLICATE
    assert status(order) == (S.PAID, 1, 0)
    row = ProcessedMessage.objects.get(message_id=msg["message_id"])
    assert (row.outcome, row.status, row.order_id) == (Outcome.APPLIED, InboxStatus.DONE, order.pk)
    assert Order.objects.get(pk=order.pk).payment_id == f"pay-{order.pk}"


def test_inbox_is_unique_per_consumer(make_order) -> None:
    order = make_order()
    msg = payment(order)
    assert consume_message(msg, consumer="payments") is Outcome.APPLIED
    # Another consumer sees the same id as a new message; the order is already paid.
    assert consume_message(msg, consumer="audit") is Outcome.DUPLICATE
    assert ProcessedMessage.objects.filter(message_id=msg["message_id"]).count() == 2


def test_same_effect_with_a_new_id_is_duplicate_and_past_is_stale(make_order) -> None:
    order = make_order()
    assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    assert consume_message(payment(order), consumer="payments") is Outcome.DUPLICATE
    assert consume_message(shipment(order), consumer="shipping") is Outcome.APPLIED
    assert consume_message(payment(order), consumer="payments") is Outcome.STALE
    assert status(order) == (S.SHIPPED, 2, 0)


def test_full_lifecycle_without_seq(make_order) -> None:
    order = make_order()
    for msg, consumer in [
        (payment(order), "payments"),
        ({"message_id": "f1", "type": "order.fulfilment", "order_id": order.pk}, "fulfilment"),
        (shipment(order), "shipping"),
        (shipment(order, "delivered"), "shipping"),
    ]:
        assert consume_message(msg, consumer=consumer) is Outcome.APPLIED
    assert status(order) == (S.COMPLETED, 4, 0)


def test_delivery_before_dispatch_is_parked_then_released(make_order) -> None:
    order = make_order()
    delivered = shipment(order, "delivered")
    assert consume_message(delivered, consumer="shipping") is Outcome.PARKED
    assert ParkedMessage.objects.filter(order=order).count() == 1
    assert consume_message(delivered, consumer="shipping") is Outcome.DUPLICATE
    assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    assert ParkedMessage.objects.filter(order=order).count() == 1  # still not shipped
    assert consume_message(shipment(order), consumer="shipping") is Outcome.APPLIED
    # The dispatch released the delivery before returning.
    assert not ParkedMessage.objects.filter(order=order).exists()
    assert status(order) == (S.COMPLETED, 3, 0)
    row = ProcessedMessage.objects.get(message_id=delivered["message_id"])
    assert row.outcome == Outcome.APPLIED


def test_sequence_gap_parks_and_fills_in_order(make_order) -> None:
    order = make_order()
    pay = payment(order, seq=1)
    ship = shipment(order, seq=2)
    deliver = shipment(order, "delivered", seq=3)
    assert consume_message(deliver, consumer="shipping") is Outcome.PARKED
    assert consume_message(ship, consumer="shipping") is Outcome.PARKED
    assert status(order) == (S.PENDING_PAYMENT, 0, 0)
    assert consume_message(pay, consumer="payments") is Outcome.APPLIED
    assert status(order) == (S.COMPLETED, 3, 3)
    assert not ParkedMessage.objects.exists()
    assert consume_message(ship, consumer="shipping") is Outcome.DUPLICATE


def test_seq_at_or_below_last_is_stale(make_order) -> None:
    order = make_order()
    assert consume_message(payment(order, seq=1), consumer="payments") is Outcome.APPLIED
    assert consume_message(payment(order, seq=1), consumer="payments") is Outcome.STALE
    assert status(order) == (S.PAID, 1, 1)


def test_in_sequence_message_without_effect_advances_last_seq(make_order) -> None:
    order = make_order()
    assert consume_message(payment(order, seq=1), consumer="payments") is Outcome.APPLIED
    # A second payment notice in slot 2 changes nothing but must not block slot 3.
    assert consume_message(shipment(order, seq=3), consumer="shipping") is Outcome.PARKED
    assert consume_message(payment(order, seq=2), consumer="payments") is Outcome.DUPLICATE
    assert status(order) == (S.SHIPPED, 2, 3)


def test_payment_for_cancelled_order_is_rejected_with_reason(make_order) -> None:
    order = make_order()
    cancel = {"message_id": "c1", "type": "order.cancelled", "order_id": order.pk}
    assert consume_message(cancel, consumer="payments") is Outcome.APPLIED
    msg = payment(order)
    assert consume_message(msg, consumer="payments") is Outcome.REJECTED
    row = ProcessedMessage.objects.get(message_id=msg["message_id"])
    assert row.status == InboxStatus.REJECTED
    assert "cancelled" in row.error
    assert "never" in row.error
    assert status(order) == (S.CANCELLED, 1, 0)


def test_second_payment_with_a_different_payment_id_is_rejected(make_order) -> None:
    order = make_order()
    assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    other = payment(order, payment_id="someone-else")
    assert consume_message(other, consumer="payments") is Outcome.REJECTED
    assert "differs" in ProcessedMessage.objects.get(message_id=other["message_id"]).error


def test_signals_are_sent_after_commit(make_order, django_capture_on_commit_callbacks) -> None:
    order = make_order()
    seen: list[dict[str, Any]] = []

    def on_transition(**kwargs: Any) -> None:
        seen.append(kwargs)

    order_transitioned.connect(on_transition)
    try:
        with django_capture_on_commit_callbacks(execute=False) as callbacks:
            consume_message(payment(order), consumer="payments")
        assert seen == []  # nothing announced before the commit
        for callback in callbacks:
            callback()
    finally:
        order_transitioned.disconnect(on_transition)
    assert [(s["transition"], s["source"], s["target"]) for s in seen] == [
        ("pay", S.PENDING_PAYMENT, S.PAID)
    ]


@pytest.mark.django_db(transaction=True)  # message_consumed is sent after commit
def test_message_consumed_signal_counts_every_outcome(make_order) -> None:
    order = make_order()
    outcomes: list[Outcome] = []

    def on_consumed(outcome: Outcome, **kwargs: Any) -> None:
        outcomes.append(outcome)

    message_consumed.connect(on_consumed)
    try:
        msg = payment(order)
        consume_message(msg, consumer="payments")
        consume_message(msg, consumer="payments")
        consume_message({"nonsense": True}, consumer="payments")
    finally:
        message_consumed.disconnect(on_consumed)
    assert outcomes == [Outcome.APPLIED, Outcome.DUPLICATE, Outcome.REJECTED]


def test_fulfilment_is_enqueued_only_after_payment_commits(
    make_order, settings, monkeypatch, django_capture_on_commit_callbacks
) -> None:
    from idempotent_orders import tasks

    sent: list[tuple[Any, ...]] = []
    monkeypatch.setattr(
        tasks.fulfil_order, "apply_async", lambda args, task_id: sent.append((args, task_id))
    )
    settings.IDEMPOTENT_ORDERS = {"FULFIL_AFTER_PAYMENT": True}
    order = make_order()
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        consume_message(payment(order), consumer="payments")
    assert sent == []  # not before the commit
    for callback in callbacks:
        callback()
    assert sent == [((order.pk,), f"fulfil-{order.pk}")]  # published from the outbox row
    with django_capture_on_commit_callbacks(execute=True):
        consume_message(payment(order), consumer="payments")  # duplicate: no second follow-up
    assert len(sent) == 1


def test_internal_type_is_rejected_on_other_consumers(make_order) -> None:
    order = make_order()
    consume_message(payment(order), consumer="payments")
    msg = {"message_id": "sneaky", "type": "order.fulfilment", "order_id": order.pk}
    assert consume_message(msg, consumer="payments") is Outcome.REJECTED
    assert "not accepted" in ProcessedMessage.objects.get(message_id="sneaky").error
    assert status(order) == (S.PAID, 1, 0)


@pytest.mark.django_db(transaction=True)
def test_receivers_connected_or_disconnected_between_messages_are_honoured(make_order) -> None:
    # The per-message signals cache their receivers; connecting and disconnecting
    # must still take effect at the next message (a sender-specific one included).
    from idempotent_orders.dedup import Layer
    from idempotent_orders.signals import dedup_answered

    first, second = make_order(), make_order()
    heard: list[tuple[str, Any]] = []

    def on_consumed(sender: Any, message_id: str, **kwargs: Any) -> None:
        heard.append(("consumed", message_id))

    def on_moved(sender: Any, order: Any, **kwargs: Any) -> None:
        heard.append(("moved", order.pk))

    def on_layer(sender: Any, layer: Any, **kwargs: Any) -> None:
        heard.append(("layer", layer))

    assert consume_message(payment(first), consumer="payments") is Outcome.APPLIED
    message_consumed.connect(on_consumed)
    order_transitioned.connect(on_moved, sender=Order)
    dedup_answered.connect(on_layer, sender=Layer)
    msg = payment(second)
    try:
        assert consume_message(msg, consumer="payments") is Outcome.APPLIED
    finally:
        message_consumed.disconnect(on_consumed)
        order_transitioned.disconnect(on_moved, sender=Order)
        dedup_answered.disconnect(on_layer, sender=Layer)
    assert ("consumed", msg["message_id"]) in heard
    assert ("moved", second.pk) in heard
    assert [h for h in heard if h[0] == "layer"]
    heard.clear()
    assert consume_message(shipment(second), consumer="shipping") is Outcome.APPLIED
    assert heard == []


def test_a_payment_that_cannot_apply_is_kept_as_money_to_give_back(make_order) -> None:
    order = make_order()
    cancel = {"message_id": f"c-{order.pk}", "type": "order.cancelled", "order_id": order.pk}
    assert consume_message(cancel, consumer="payments") is Outcome.APPLIED
    late = payment(order)
    assert consume_message(late, consumer="payments") is Outcome.REJECTED
    row = ProcessedMessage.objects.get(consumer="payments", message_id=late["message_id"])
    assert row.error.endswith("the payment is money to give back")
    assert '"payment_id": "pay-' in row.body  # kept, to give it back


@pytest.mark.parametrize("path", ["single", "batch"])
def test_a_second_charge_or_a_wrong_amount_is_money_to_give_back(make_order, path: str) -> None:
    from idempotent_orders.admin.dashboard import money_to_give_back
    from idempotent_orders.consuming.batch import consume_batch

    def consume(message: dict[str, Any]) -> Outcome:
        if path == "batch":
            return consume_batch([message], consumer="payments")[0]
        return consume_message(message, consumer="payments")

    order = make_order()
    assert consume(payment(order, payment_id=f"pi-a-{order.pk}")) is Outcome.APPLIED
    # Another payment intent for the same order: charged twice by the customer.
    second = {**payment(order, payment_id=f"pi-b-{order.pk}"), "message_id": f"b-{order.pk}"}
    assert consume(second) is Outcome.REJECTED
    other = make_order()
    wrong = payment(other)
    wrong["payload"]["amount"] = "99.00"
    assert consume(wrong) is Outcome.REJECTED
    rows = ProcessedMessage.objects.filter(
        message_id__in=[second["message_id"], wrong["message_id"]]
    )
    for row in rows:
        assert row.error.endswith("; the payment is money to give back"), row.error
    assert money_to_give_back().filter(pk__in=[r.pk for r in rows]).count() == 2


@pytest.mark.parametrize("path", ["single", "batch"])
def test_one_payment_pays_one_order(make_order, path: str) -> None:
    from idempotent_orders.consuming.batch import consume_batch
    from idempotent_orders.models import SpentPayment

    first, second = make_order(), make_order()
    charge = f"ch-{first.pk}"
    paid = payment(first, payment_id=charge)
    again = payment(second, payment_id=charge)  # the same charge, another order

    def consume(message: dict[str, Any]) -> Outcome:
        if path == "batch":
            return consume_batch([message], consumer="payments")[0]
        return consume_message(message, consumer="payments")

    assert consume(paid) is Outcome.APPLIED
    assert consume(again) is Outcome.REJECTED
    row = ProcessedMessage.objects.get(consumer="payments", message_id=again["message_id"])
    assert row.error == (
        f"payment {charge} already paid order {first.pk}; the payment is money to give back"
    )
    assert status(second) == (S.PENDING_PAYMENT, 0, 0)
    assert list(SpentPayment.objects.values_list("payment_id", "order_id")) == [(charge, first.pk)]


@pytest.mark.parametrize("path", ["single", "batch"])
def test_a_message_id_reused_with_another_payload_is_kept_and_flagged(
    make_order, path: str
) -> None:
    from idempotent_orders.consuming.batch import consume_batch

    first, second = make_order(), make_order()
    original = payment(first, message_id=f"reused-{first.pk}")
    impostor = payment(second, message_id=original["message_id"])  # same id, other order

    def consume(message: dict[str, Any]) -> Outcome:
        if path == "batch":
            return consume_batch([message], consumer="payments")[0]
        return consume_message(message, consumer="payments")

    assert consume(original) is Outcome.APPLIED
    assert consume(original) is Outcome.DUPLICATE  # the same message: a duplicate
    assert consume(impostor) is Outcome.REJECTED
    flagged = ProcessedMessage.objects.get(consumer="payments", message_id__startswith="reused:")
    assert flagged.error.startswith(f"message id {original['message_id']} was used before")
    assert flagged.order_id == second.pk
    assert f'"order_id": {second.pk}' in flagged.body
    assert consume(impostor) is Outcome.DUPLICATE  # kept once
    assert status(second) == (S.PENDING_PAYMENT, 0, 0)
    assert ProcessedMessage.objects.filter(consumer="payments").count() == 2


@pytest.mark.django_db(transaction=True)  # message_consumed is sent after commit
@pytest.mark.parametrize("listening", [False, True])
def test_every_outcome_of_a_message_is_counted_whether_or_not_anyone_listens(
    make_order, listening: bool
) -> None:
    # With only the app's own counters connected, consume_message counts its outcome
    # without sending the signal; a receiver of anyone's gets every message as before.
    from collections import Counter

    from idempotent_orders import stats

    def metric(outcome: Outcome) -> float:
        return messages_decided("payments", outcome)

    heard: list[tuple[str, Outcome, str]] = []

    def on_consumed(
        sender: Any, message_id: str, outcome: Outcome, reason: str, **kwargs: Any
    ) -> None:
        heard.append((message_id, outcome, reason))

    order = make_order()
    unknown = {**payment(order), "message_id": "to-nowhere", "order_id": 10**9}
    messages = [payment(order), payment(order), unknown]
    stats.reset()
    before = {o: metric(o) for o in Outcome}
    if listening:
        message_consumed.connect(on_consumed)
    try:
        outcomes = [consume_message(m, consumer="payments") for m in messages]
    finally:
        message_consumed.disconnect(on_consumed)
    assert outcomes == [Outcome.APPLIED, Outcome.DUPLICATE, Outcome.REJECTED]
    expected = Counter(outcomes)
    assert outcome_counts() == {f"outcome:{o}": n for o, n in expected.items()}
    assert {o: metric(o) - before[o] for o in expected} == {
        o: float(n) for o, n in expected.items()
    }
    if listening:
        assert [(m, o) for m, o, _ in heard] == [
            (m["message_id"], o) for m, o in zip(messages, outcomes, strict=True)
        ]
        assert "unknown order" in heard[2][2]
    else:
        assert heard == []
