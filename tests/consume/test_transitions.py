"""The transition graph comes from django-fsm-2; apply_transition commits it with one UPDATE."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from idempotent_orders.consuming.graph import (
    TransitionStatus,
    classify,
    edge,
    edges,
    reachable_from,
)
from idempotent_orders.consuming.running import apply_transition
from idempotent_orders.models import Order, OrderStatus

pytestmark = pytest.mark.django_db

S = OrderStatus


def test_graph_is_read_from_the_fsm_declarations() -> None:
    graph = {e.name: (set(e.sources), e.target) for e in edges(Order)}
    assert graph == {
        "pay": ({S.PENDING_PAYMENT}, S.PAID),
        "start_processing": ({S.PAID}, S.PROCESSING),
        "ship": ({S.PAID, S.PROCESSING}, S.SHIPPED),
        "complete": ({S.SHIPPED}, S.COMPLETED),
        "cancel": ({S.PENDING_PAYMENT}, S.CANCELLED),
        "expire": ({S.PENDING_PAYMENT}, S.EXPIRED),
        "refund": ({S.PAID}, S.REFUNDED),
    }
    assert reachable_from(Order, S.PAID) == {S.PROCESSING, S.SHIPPED, S.COMPLETED, S.REFUNDED}
    assert reachable_from(Order, S.COMPLETED) == frozenset()


@pytest.mark.parametrize(
    ("name", "current", "expected"),
    [
        ("pay", S.PENDING_PAYMENT, TransitionStatus.APPLIED),
        ("pay", S.PAID, TransitionStatus.AT_TARGET),
        ("pay", S.SHIPPED, TransitionStatus.PAST_TARGET),
        ("pay", S.CANCELLED, TransitionStatus.NOT_ALLOWED),
        ("complete", S.PENDING_PAYMENT, TransitionStatus.LATER),
        ("ship", S.PROCESSING, TransitionStatus.APPLIED),
        ("start_processing", S.SHIPPED, TransitionStatus.PAST_TARGET),
        ("refund", S.SHIPPED, TransitionStatus.NOT_ALLOWED),
        ("cancel", S.PAID, TransitionStatus.NOT_ALLOWED),
    ],
)
def test_classify(name: str, current: str, expected: TransitionStatus) -> None:
    assert classify(Order, name, current) is expected


def test_status_cannot_be_assigned_directly(make_order) -> None:
    order = make_order()
    with pytest.raises(AttributeError):
        order.status = S.PAID


def test_apply_is_one_conditional_update(make_order) -> None:
    order = make_order()
    with CaptureQueriesContext(connection) as queries:
        result = apply_transition(order, "pay", fields={"payment_id": "p1"})
    assert result.status is TransitionStatus.APPLIED
    assert len(queries) == 1
    sql = queries[0]["sql"].upper()
    assert sql.startswith("UPDATE")
    assert "VERSION" in sql
    assert "STATUS" in sql
    assert (order.status, order.version) == (S.PAID, 1)
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version, row.payment_id) == (S.PAID, 1, "p1")


def test_lost_race_is_a_conflict_and_leaves_instance_untouched(make_order) -> None:
    order = make_order()
    other = Order.objects.get(pk=order.pk)
    assert apply_transition(other, "cancel").applied
    result = apply_transition(order, "pay")
    assert result.status is TransitionStatus.CONFLICT
    assert (order.status, order.version) == (S.PENDING_PAYMENT, 0)
    assert Order.objects.get(pk=order.pk).status == S.CANCELLED


def test_stale_version_alone_is_a_conflict(make_order) -> None:
    order = make_order()
    Order.objects.filter(pk=order.pk).update(amount=Decimal("1.00"), version=7)
    assert apply_transition(order, "pay").status is TransitionStatus.CONFLICT
    assert Order.objects.get(pk=order.pk).status == S.PENDING_PAYMENT


def test_not_allowed_and_past_do_not_touch_the_database(make_order) -> None:
    order = make_order()
    with CaptureQueriesContext(connection) as queries:
        assert apply_transition(order, "complete").status is TransitionStatus.LATER
    assert len(queries) == 0
    assert apply_transition(order, "cancel").applied
    assert apply_transition(order, "pay").status is TransitionStatus.NOT_ALLOWED
    assert apply_transition(order, "cancel").status is TransitionStatus.AT_TARGET


def test_unknown_transition_name(make_order) -> None:
    from idempotent_orders.exceptions import UnknownTransition

    with pytest.raises(UnknownTransition):
        edge(Order, "teleport")
