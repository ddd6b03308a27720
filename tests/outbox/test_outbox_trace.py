"""The producer's trace context travels with the outbox row and is current in the consumer."""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from django.db import transaction
from django.test import override_settings

from demo_project.tasks import award_points
from idempotent_orders import tracing
from idempotent_orders.observability import JsonFormatter
from idempotent_orders.outbox import publish_on_commit, relay_outbox
from idempotent_orders.receivers import forget_trace, restore_trace
from tests.support.services import wait_until

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
NO_IMMEDIATE = {"OUTBOX_PUBLISH_ON_COMMIT": False}


def message() -> dict[str, Any]:
    return {"message_id": f"out-{uuid.uuid4().hex}", "customer": "erin", "points": 5}


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(award_points, "apply_async", lambda **kw: calls.append(kw))
    return calls


@pytest.mark.django_db
@override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE)
def test_the_current_context_is_stored_and_sent_as_headers(sent: list[dict[str, Any]]) -> None:
    with tracing.use(TP, "checkout-42"):
        row = publish_on_commit(award_points, message(), headers={"x-tenant": "t1"})
    plain = publish_on_commit(award_points, message())
    assert (row.traceparent, row.correlation_id) == (TP, "checkout-42")
    assert (plain.traceparent, plain.correlation_id) == ("", "")
    relay_outbox()
    assert sent[0]["headers"] == {
        "x-tenant": "t1",
        "traceparent": TP,
        "x-correlation-id": "checkout-42",
    }
    assert "headers" not in sent[1]


@pytest.mark.django_db
@override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE)
def test_explicit_arguments_win_and_a_bad_traceparent_is_refused() -> None:
    other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracing.use(TP, "ctx"):
        row = publish_on_commit(award_points, message(), traceparent=other, correlation_id="arg")
    assert (row.traceparent, row.correlation_id) == (other, "arg")
    with pytest.raises(ValueError, match="traceparent"):
        publish_on_commit(award_points, message(), traceparent="00-nothex-01")
    assert not tracing.valid_traceparent("00-" + "0" * 32 + "-00f067aa0ba902b7-01")


def test_restored_around_a_task_and_logged() -> None:
    # Celery's request: its own correlation_id is the task id, ours is a header.
    request = SimpleNamespace(
        is_eager=False, traceparent=TP, correlation_id="t-1", headers={"x-correlation-id": "c-1"}
    )
    task = SimpleNamespace(request=request)
    assert tracing.current() == tracing.TraceContext()
    restore_trace(task_id="t-1", task=task)
    try:
        assert tracing.current() == tracing.TraceContext(TP, "c-1")
        record = logging.LogRecord("idempotent_orders", logging.INFO, "", 0, "hello", (), None)
        assert tracing.TraceLogFilter().filter(record)
        line = json.loads(JsonFormatter().format(record))
        assert (line["traceparent"], line["correlation_id"]) == (TP, "c-1")
    finally:
        forget_trace(task_id="t-1", task=task)
    assert tracing.current() == tracing.TraceContext()


@pytest.mark.services
@pytest.mark.workers
def test_trace_travels_through_a_real_worker_and_its_follow_up(
    celery_workers: Any, tmp_path: Path
) -> None:
    celery_workers("redis", processes=1, concurrency=1)
    out = tmp_path / "hops.jsonl"
    with tracing.use(TP, "order-7"), transaction.atomic():
        publish_on_commit("tests.record_trace", {"path": str(out), "hop": 1, "hops": 2})

    def hops() -> list[dict[str, Any]]:
        return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []

    assert wait_until(lambda: len(hops()) == 2, timeout=90), hops()
    assert hops() == [
        {"hop": 1, "traceparent": TP, "correlation_id": "order-7"},
        {"hop": 2, "traceparent": TP, "correlation_id": "order-7"},
    ]
