"""The batch's one conditional UPDATE of many orders on MariaDB and SQLite, written as SQL
(the portable ``Backend.update_orders``)."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from idempotent_orders.consuming.backends import Backend
from idempotent_orders.models import Order, OrderStatus

pytestmark = [pytest.mark.django_db, pytest.mark.backends("sqlite", "mysql")]


def test_each_order_gets_its_own_values_and_only_at_the_version_read(make_order) -> None:
    first, second, stale = make_order(), make_order(), make_order()
    Order.objects.filter(pk=stale.pk).update(version=1)  # moved since the batch read it
    changed = {
        first.pk: {"status": OrderStatus.PAID, "payment_id": "p-1", "amount": Decimal("3.10")},
        second.pk: {"status": OrderStatus.PAID, "payment_id": "p-2"},
        stale.pk: {"status": OrderStatus.PAID, "payment_id": "p-3"},
    }
    with CaptureQueriesContext(connection) as queries:
        rows = Backend().update_orders(
            Order,
            changed,
            {first.pk: 0, second.pk: 0, stale.pk: 0},
            ["amount", "payment_id", "status"],
        )
    assert rows == 2
    assert len(queries.captured_queries) == 1
    got = {o.pk: (o.status, o.payment_id, o.amount) for o in Order.objects.filter(pk__in=changed)}
    assert got == {
        first.pk: (OrderStatus.PAID, "p-1", Decimal("3.10")),
        second.pk: (OrderStatus.PAID, "p-2", Decimal("12.50")),  # amount not in its values
        stale.pk: (OrderStatus.PENDING_PAYMENT, "", Decimal("12.50")),
    }
