"""Structured logs with message_id/order_id, and the Prometheus metrics the demo exposes."""

from __future__ import annotations

import json
import logging

import pytest
from django.test import Client

from demo_project import warehouse
from idempotent_orders import reconcile
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.fulfilment import fulfil
from idempotent_orders.observability import JsonFormatter, record_layer_hit
from tests.support.messages import payment
from tests.support.metrics import sample

pytestmark = pytest.mark.django_db


def test_json_logs_carry_message_and_order_ids(make_order, caplog) -> None:
    order = make_order()
    consume_message(payment(order), consumer="payments")
    warehouse.script(order.pk, "fail")
    caplog.set_level(logging.INFO, logger="idempotent_orders")
    fulfil(order.pk)
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records]
    assert [line["message"] for line in lines] == [
        f"claimed fulfil-{order.pk} (fulfilment)",
        f"fulfilment failed for fulfil-{order.pk}: "
        "WarehouseError('the warehouse refused the request')",
    ]
    for line in lines:
        assert (line["message_id"], line["order_id"]) == (f"fulfil-{order.pk}", order.pk)
    assert lines[1]["level"] == "WARNING"


@pytest.mark.django_db(transaction=True)  # message_consumed is sent after commit
def test_metrics_count_outcomes_stuck_rows_and_lag(make_order) -> None:
    client = Client()
    before = client.get("/metrics").content.decode()
    order = make_order()
    consume_message(payment(order), consumer="payments")
    consume_message(payment(order, seq=None, message_id="dup"), consumer="payments")
    warehouse.script(order.pk, "fail")
    fulfil(order.pk)
    record_layer_hit("redis")

    response = client.get("/metrics")
    assert response.status_code == 200
    text = response.content.decode()

    def grew(name: str, **labels: str) -> float:
        return sample(text, name, **labels) - sample(before, name, **labels)

    assert grew("idempotent_orders_messages_total", consumer="payments", outcome="applied") == 1
    assert grew("idempotent_orders_messages_total", consumer="payments", outcome="duplicate") == 1
    assert grew("idempotent_orders_dedup_layer_hits_total", layer="redis") == 1
    assert grew("idempotent_orders_leases_total", consumer="fulfilment", result="retry") == 1
    assert sample(text, "idempotent_orders_stuck_processing") == 1
    assert sample(text, "idempotent_orders_consumer_lag_seconds", consumer="fulfilment") >= 0
    assert "idempotent_orders_consumer_lag_seconds{" in text

    reconcile.reconcile()
    after = client.get("/metrics").content.decode()
    assert sample(after, "idempotent_orders_stuck_processing") == 0
    assert (
        sample(
            after, "idempotent_orders_reconciled_total", consumer="fulfilment", action="completed"
        )
        - sample(
            text, "idempotent_orders_reconciled_total", consumer="fulfilment", action="completed"
        )
        == 1
    )
