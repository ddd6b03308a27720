"""The whole guarantee on a project's own order model (``shop.Order``, swapped in by setting).

``shop.Order`` names its state field ``phase``, has its own states, an extra
transition (``hold``), a condition on ``settle`` and no ``payment_id`` column.
This module runs in its own pytest process under ``tests.settings_swapped``.
"""

from __future__ import annotations

import random
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django_fsm.signals import post_transition, pre_transition

from idempotent_orders import get_order_model
from idempotent_orders.checks import check_order_model
from idempotent_orders.consuming import registry
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.fulfilment import fulfil
from idempotent_orders.models import (
    Order as DefaultOrder,
)
from idempotent_orders.models import (
    OutboxMessage,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.orders import create_order
from idempotent_orders.tasks import publish
from tests.shop.models import Order, Phase
from tests.support.messages import payment, shipment
from tests.support.services import wait_until
from tests.support.threads import run_threads

A, D, P, R, ST = (
    Outcome.APPLIED,
    Outcome.DUPLICATE,
    Outcome.PARKED,
    Outcome.REJECTED,
    Outcome.STALE,
)


def lifecycle(order: Order) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("payments", payment(order, message_id=f"p-{order.pk}", seq=1)),
        ("shipping", shipment(order, message_id=f"d-{order.pk}", seq=2)),
        ("shipping", shipment(order, "delivered", message_id=f"c-{order.pk}", seq=3)),
    ]


def storm(orders: list[Order], seed: int) -> list[tuple[str, dict[str, Any]]]:
    """Every order's messages, each delivered one to four times, in a random order."""
    rng = random.Random(seed)
    deliveries = [d for o in orders for d in lifecycle(o) for _ in range(rng.randint(1, 4))]
    rng.shuffle(deliveries)
    return deliveries


def assert_all_received_once(orders: list[Order]) -> None:
    for order in Order.objects.filter(pk__in=[o.pk for o in orders]):
        assert (order.phase, order.version, order.last_seq) == (Phase.RECEIVED, 3, 3), order
        assert order.tracking_number == f"TRK{order.pk}"
        applied = ProcessedMessage.objects.filter(order_id=order.pk, outcome=Outcome.APPLIED)
        assert applied.count() == 3
    assert not ParkedMessage.objects.exists()


@pytest.mark.django_db
def test_the_setting_swaps_the_model_and_its_migrations() -> None:
    assert get_order_model() is Order
    assert DefaultOrder._meta.swapped == "shop.Order"
    tables = connection.introspection.table_names()
    assert Order._meta.db_table in tables
    assert DefaultOrder._meta.db_table not in tables  # never created from nothing
    inbox_fk = ProcessedMessage._meta.get_field("order")
    assert inbox_fk.related_model is Order
    out = StringIO()
    call_command("makemigrations", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()
    assert check_order_model() == []


def test_a_type_bound_to_a_missing_transition_is_a_check_error() -> None:
    registry.register("parcel.lost", transition="lose")
    try:
        errors = check_order_model()
    finally:
        registry._registry.pop("parcel.lost")
    assert [e.id for e in errors] == ["idempotent_orders.E043"]
    assert "'lose'" in errors[0].msg
    assert "shop.Order" in errors[0].msg


@pytest.mark.django_db
def test_a_duplicated_permuted_stream_applies_once_on_both_paths(make_order) -> None:
    single = [make_order() for _ in range(4)]
    for consumer, message in storm(single, seed=1):
        consume_message(message, consumer=consumer)
    assert_all_received_once(single)

    batched = [make_order() for _ in range(4)]
    deliveries = storm(batched, seed=1)
    rng = random.Random(2)
    while deliveries:
        size = rng.randint(1, 7)
        chunk, deliveries = deliveries[:size], deliveries[size:]
        for consumer in ("payments", "shipping"):
            mine = [m for c, m in chunk if c == consumer]
            if mine:
                consume_batch(mine, consumer=consumer)
    assert_all_received_once(batched)


@pytest.mark.django_db
def test_parking_by_graph_and_the_extra_transition(make_order) -> None:
    order = make_order()
    deliver, dispatch = shipment(order, "delivered"), shipment(order)
    held = {"message_id": f"h-{order.pk}", "type": "warehouse.held", "order_id": order.pk}
    assert consume_message(deliver, consumer="shipping") is P
    assert consume_message(held, consumer="shipping") is P  # picking is not reached yet
    assert consume_message(payment(order), consumer="payments") is A
    row = Order.objects.get(pk=order.pk)
    assert row.phase == Phase.SETTLED  # the delivery still waits for a dispatch
    assert fulfil(order.pk) is A  # settled -> picking through the leased step
    # The step released the parked hold: picking -> on hold.
    assert ProcessedMessage.objects.get(message_id=held["message_id"]).outcome == A
    row = Order.objects.get(pk=order.pk)
    assert row.phase == Phase.ON_HOLD
    assert consume_message(dispatch, consumer="shipping") is A
    row = Order.objects.get(pk=order.pk)
    assert row.phase == Phase.RECEIVED  # the parked delivery followed the dispatch
    assert row.version == 5
    assert not ParkedMessage.objects.exists()


@pytest.mark.django_db
def test_conditions_are_honoured_and_named(make_order) -> None:
    blocked = make_order(blocked=True)
    message = payment(blocked)
    assert consume_message(message, consumer="payments") is R
    row = ProcessedMessage.objects.get(message_id=message["message_id"])
    assert "not_blocked" in row.error
    assert Order.objects.get(pk=blocked.pk).phase == Phase.NEW

    blocked2 = make_order(blocked=True)
    message2 = payment(blocked2)
    assert consume_batch([message2], consumer="payments") == [R]
    assert "not_blocked" in ProcessedMessage.objects.get(message_id=message2["message_id"]).error
    assert Order.objects.get(pk=blocked2.pk).version == 0


@pytest.mark.django_db
def test_fsm_signals_are_sent_once_per_applied_transition(make_order) -> None:
    seen: list[tuple[str, str, str, str]] = []

    def record(signal: str):
        def receiver(sender: Any, instance: Any, name: str, source: str, target: str, **kw: Any):
            assert sender is Order
            seen.append((signal, name, source, target))

        return receiver

    pre, post = record("pre"), record("post")
    pre_transition.connect(pre)
    post_transition.connect(post)
    try:
        order, other = make_order(), make_order()
        consume_message(payment(order), consumer="payments")
        consume_message(payment(order), consumer="payments")  # another id, a duplicate
        consume_batch([payment(other), shipment(other)], consumer="payments")
    finally:
        pre_transition.disconnect(pre)
        post_transition.disconnect(post)
    # The batch runs the model's own transitions one after the other, as the single
    # path and fsm-2 do: each post_transition before the next pre_transition.
    assert seen == [
        ("pre", "settle", "new", "settled"),
        ("post", "settle", "new", "settled"),
        ("pre", "settle", "new", "settled"),
        ("post", "settle", "new", "settled"),
        ("pre", "send", "settled", "sent"),
        ("post", "send", "settled", "sent"),
    ]


@pytest.mark.django_db(transaction=True)
def test_payment_queues_fulfilment_in_its_transaction(make_order, settings) -> None:
    settings.IDEMPOTENT_ORDERS = {
        **settings.IDEMPOTENT_ORDERS,
        "FULFIL_AFTER_PAYMENT": True,
        "OUTBOX_PUBLISH_ON_COMMIT": False,
    }
    order = make_order()
    assert consume_message(payment(order), consumer="payments") is A
    assert OutboxMessage.objects.get(message_id=f"fulfil-{order.pk}").payload == order.pk
    shipped = make_order()
    consume_message(payment(shipped, seq=1), consumer="payments")
    consume_message(shipment(shipped, seq=2), consumer="shipping")
    # Only entering a source state of `pick` (settled) queues the step, once per order.
    assert OutboxMessage.objects.count() == 2


@pytest.mark.django_db
def test_create_order_uses_the_swapped_model() -> None:
    items = [{"sku": "tea", "quantity": 2}]
    first, created = create_order(customer=None, items=items, amount="9.90", currency="CNY")
    again, created_again = create_order(customer=None, items=items, amount="9.90", currency="CNY")
    assert isinstance(first, Order)
    assert created
    assert not created_again
    assert again.pk == first.pk


@pytest.mark.django_db(transaction=True)
@pytest.mark.backends("postgresql", "mysql")
def test_threads_deliver_a_storm_exactly_once(make_order) -> None:
    orders = [make_order() for _ in range(6)]
    deliveries = storm(orders, seed=3)
    outcomes = run_threads(deliveries, 4)
    assert sum(outcomes.values()) == len(deliveries)
    assert_all_received_once(orders)


@pytest.mark.workers
@pytest.mark.backends("postgresql")
def test_worker_processes_apply_a_storm_once(celery_workers, make_order) -> None:
    workers = celery_workers("rabbitmq", processes=2)
    orders = [make_order() for _ in range(8)]
    for consumer, message in storm(orders, seed=4):
        publish(message, consumer=consumer)
    ids = [o.pk for o in orders]
    done = wait_until(
        lambda: Order.objects.filter(pk__in=ids, phase=Phase.RECEIVED).count() == len(ids),
        timeout=120,
    )
    assert done, workers.log_tail()
    assert_all_received_once(orders)
    assert settings.IDEMPOTENT_ORDERS_ORDER_MODEL == "shop.Order"


@pytest.mark.django_db
def test_the_reconciler_completes_a_lost_reply_on_the_own_model(make_order) -> None:
    from demo_project import warehouse
    from idempotent_orders import reconcile
    from idempotent_orders.leases import StepResult

    order = make_order()
    consume_message(payment(order), consumer="payments")
    warehouse.script(order.pk, "lose_reply")
    assert fulfil(order.pk) is StepResult.RETRY
    assert Order.objects.get(pk=order.pk).phase == Phase.SETTLED
    assert reconcile.reconcile().actions == {"completed": 1}
    row = Order.objects.get(pk=order.pk)
    assert (row.phase, row.version) == (Phase.PICKING, 2)
    assert warehouse.effects(order.pk) == 1
    assert reconcile.reconcile().actions == {}


@pytest.mark.django_db
def test_setting_the_model_after_the_first_migrate_is_explained() -> None:
    """E045: this app's migrations recorded before those of the order model's app."""
    from django.core.checks import run_checks
    from django.db import connection
    from django.db.migrations.recorder import MigrationRecorder

    def e045() -> list[Any]:
        found = run_checks(databases=["default"])
        return [m for m in found if m.id == "idempotent_orders.E045"]

    assert e045() == []
    recorder = MigrationRecorder(connection)
    recorder.migration_qs.filter(app="shop", name="0001_initial").delete()
    errors = e045()
    assert len(errors) == 1
    assert "shop.Order" in errors[0].msg
    assert "migrate idempotent_orders zero" in (errors[0].hint or "")
