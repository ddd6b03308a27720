"""Many threads and processes deliver copies of the same messages at once: each applies once."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection

from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import Order, OrderStatus, Outcome, ParkedMessage, ProcessedMessage
from tests.support.messages import payment, shipment
from tests.support.services import ROOT
from tests.support.threads import run_threads

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.races]


def lifecycle(order: Order) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("payments", payment(order, message_id=f"p-{order.pk}", seq=1)),
        ("shipping", shipment(order, message_id=f"d-{order.pk}", seq=2)),
        ("shipping", shipment(order, "delivered", message_id=f"c-{order.pk}", seq=3)),
    ]


def assert_exactly_once(orders: list[Order], n_messages: int) -> None:
    for order in Order.objects.filter(pk__in=[o.pk for o in orders]):
        assert (order.status, order.version, order.last_seq) == (OrderStatus.COMPLETED, 3, 3)
    rows = ProcessedMessage.objects.filter(order__in=orders)
    assert rows.count() == n_messages
    assert rows.filter(outcome=Outcome.APPLIED).count() == n_messages
    assert not ParkedMessage.objects.exists()


def test_threads_race_on_the_same_messages(make_order) -> None:
    orders = [make_order() for _ in range(8)]
    messages = [m for o in orders for m in lifecycle(o)]
    rng = random.Random(7)
    deliveries = [m for m in messages for _ in range(rng.randint(2, 5))]
    rng.shuffle(deliveries)
    threads = 8 if connection.vendor != "sqlite" else 4
    outcomes = run_threads(deliveries, threads)
    # A parked delivery is applied later by whichever call fills its gap, so the
    # per-call outcomes count it as parked; the inbox holds the final word.
    assert outcomes["applied"] + outcomes["parked"] >= len(messages)
    assert sum(outcomes.values()) == len(deliveries)
    assert outcomes["rejected"] == 0
    assert_exactly_once(orders, len(messages))


def test_one_message_many_threads_applies_once(make_order) -> None:
    order = make_order()
    msg = payment(order, message_id="the-one")
    outcomes = run_threads([("payments", msg)] * 16, 16 if connection.vendor != "sqlite" else 4)
    assert outcomes["applied"] == 1
    assert outcomes["duplicate"] == sum(outcomes.values()) - 1
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version) == (OrderStatus.PAID, 1)


def test_competing_transitions_lose_no_update(make_order) -> None:
    """Fulfilment and dispatch race from `paid`: both end applied or stale, never lost."""
    orders = [make_order() for _ in range(10)]
    for order in orders:
        consume_message(payment(order), consumer="payments")
    deliveries = []
    for order in orders:
        deliveries.append(
            (
                "fulfilment",
                {"message_id": f"f-{order.pk}", "type": "order.fulfilment", "order_id": order.pk},
            )
        )
        deliveries.append(("shipping", shipment(order, message_id=f"s-{order.pk}")))
    random.Random(3).shuffle(deliveries)
    run_threads(deliveries * 3, 6 if connection.vendor != "sqlite" else 3)
    for order in Order.objects.filter(pk__in=[o.pk for o in orders]):
        applied = order.inbox_messages.filter(outcome=Outcome.APPLIED).count()
        assert order.status == OrderStatus.SHIPPED
        assert order.version == applied  # every applied message bumped the version once
        assert applied in (2, 3)


@pytest.mark.backends("postgresql", "mysql")
def test_processes_race_on_the_same_messages(make_order, tmp_path) -> None:
    orders = [make_order(amount=Decimal("9.90")) for _ in range(10)]
    messages = [m for o in orders for m in lifecycle(o)]
    rng = random.Random(11)
    procs = []
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "IO_WORKER_DB": "1"}
    for i in range(4):
        deliveries = [m for m in messages for _ in range(rng.randint(1, 3))]
        rng.shuffle(deliveries)
        path = tmp_path / f"deliveries-{i}.json"
        path.write_text(json.dumps(deliveries))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.support.consume_in_process", str(path)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    totals: Counter[str] = Counter()
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-3000:]
        totals.update(json.loads(out))
    assert totals["applied"] + totals["parked"] >= len(messages)
    assert totals["rejected"] == 0
    assert_exactly_once(orders, len(messages))
