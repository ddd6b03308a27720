"""The batch's follow-ups written together: the fulfilment outbox rows of a chunk by one
multi-row INSERT, handed to the publisher together, the same rows as one by one."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.test.utils import CaptureQueriesContext, override_settings

from idempotent_orders import tracing
from idempotent_orders.consuming import running
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.consuming.sql import inbox_partitioned
from idempotent_orders.fulfilment import QueueFulfilment
from idempotent_orders.models import Order, OrderStatus, OutboxMessage, Outcome, ProcessedMessage
from idempotent_orders.outbox import producer, relay
from tests.support.messages import payment

TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
COLUMNS = (
    "message_id",
    "task_name",
    "payload",
    "options",
    "status",
    "attempts",
    "last_error",
    "order_key",
    "traceparent",
    "correlation_id",
)


def _fulfil(**more: Any) -> override_settings:
    return override_settings(
        IDEMPOTENT_ORDERS={
            **settings.IDEMPOTENT_ORDERS,
            "FULFIL_AFTER_PAYMENT": True,
            "OUTBOX_PUBLISH_ON_COMMIT": False,
            **more,
        }
    )


def _rows(orders: list[Any]) -> list[tuple[Any, ...]]:
    """The outbox rows of ``orders``, in id order, with each order's id replaced by its place."""
    place = {o.pk: n for n, o in enumerate(orders)}
    rows = OutboxMessage.objects.filter(message_id__in=[f"fulfil-{o.pk}" for o in orders]).order_by(
        "id"
    )
    found = []
    for row in rows.values_list(*COLUMNS):
        n = place[row[2]]
        found.append((f"fulfil-#{n}", row[1], n, *row[3:]))
    return found


@pytest.mark.django_db
def test_the_batch_writes_the_outbox_rows_one_by_one_would_write(make_order, monkeypatch) -> None:
    handed_over = [make_order() for _ in range(5)]
    one_by_one = [make_order() for _ in range(5)]
    with _fulfil(), tracing.use(TRACE, "batch-7"):
        with CaptureQueriesContext(connection) as queries:
            assert (
                consume_batch([payment(o) for o in handed_over], consumer="payments")
                == [Outcome.APPLIED] * 5
            )
        table = OutboxMessage._meta.db_table
        inserts = [q for q in queries if q["sql"].startswith("INSERT") and table in q["sql"]]
        assert len(inserts) == 1, "one INSERT for the chunk's follow-ups"
        # A follow-up without write_many: its row written once per applied order.
        monkeypatch.delattr(QueueFulfilment, "write_many")
        with CaptureQueriesContext(connection) as queries:
            assert (
                consume_batch([payment(o) for o in one_by_one], consumer="payments")
                == [Outcome.APPLIED] * 5
            )
        inserts = [q for q in queries if q["sql"].startswith("INSERT") and table in q["sql"]]
        assert len(inserts) == 5
    written = _rows(handed_over)
    assert written == _rows(one_by_one)
    assert len(written) == 5
    assert written[0][1] == "idempotent_orders.fulfil_order"
    assert (written[0][-2], written[0][-1]) == (TRACE, "batch-7")


@pytest.mark.django_db
def test_a_follow_up_queued_already_is_neither_written_nor_published_again(make_order) -> None:
    orders = [make_order() for _ in range(3)]
    # The first order's fulfilment row exists already (queued by hand, another payload).
    producer.publish_on_commit(
        "idempotent_orders.fulfil_order", "by hand", message_id=f"fulfil-{orders[0].pk}"
    )
    with _fulfil():
        assert (
            consume_batch([payment(o) for o in orders], consumer="payments")
            == [Outcome.APPLIED] * 3
        )
    rows = dict(OutboxMessage.objects.values_list("message_id", "payload"))
    assert rows == {
        f"fulfil-{orders[0].pk}": "by hand",
        f"fulfil-{orders[1].pk}": orders[1].pk,
        f"fulfil-{orders[2].pk}": orders[2].pk,
    }
    # Repeated within one call: the first is the message.
    written = producer.publish_many_on_commit(
        "t", [("m-1", 1), ("m-2", 2), ("m-1", 3), (f"fulfil-{orders[1].pk}", 4)]
    )
    assert list(written) == ["m-1", "m-2"]
    assert OutboxMessage.objects.get(message_id="m-1").payload == 1
    assert OutboxMessage.objects.get(pk=written["m-2"]).payload == 2
    assert OutboxMessage.objects.get(message_id=f"fulfil-{orders[1].pk}").payload == orders[1].pk


@pytest.mark.django_db(transaction=True)
def test_the_chunks_rows_are_published_after_commit_together(make_order, monkeypatch) -> None:
    published: list[list[int]] = []
    real = relay.relay_outbox

    def record(*, ids: list[int] | None = None, **kwargs: Any) -> Any:
        published.append(list(ids or []))
        return real(ids=ids, **kwargs)

    monkeypatch.setattr(relay, "relay_outbox", record)
    orders = [make_order() for _ in range(4)]
    with _fulfil(OUTBOX_PUBLISH_ON_COMMIT=True, OUTBOX_PUBLISHER_THREAD=False):
        assert (
            consume_batch([payment(o) for o in orders], consumer="payments")
            == [Outcome.APPLIED] * 4
        )
    ids = list(OutboxMessage.objects.order_by("id").values_list("id", flat=True))
    assert published == [ids]  # one hand-off, after commit, with every row of the chunk
    assert set(OutboxMessage.objects.values_list("status", flat=True)) == {"sent"}


@pytest.mark.django_db(transaction=True)
def test_a_follow_up_that_raises_in_the_batch_loses_nothing(make_order) -> None:
    calls: list[str] = []

    class Failing:
        def wanted(self, model: Any, target: Any) -> bool:
            return target == OrderStatus.PAID

        def write(self, instance: Any, name: str, result: Any) -> None:
            calls.append("write")
            raise RuntimeError("the follow-up is down")

        def write_many(self, written: list[Any]) -> None:
            calls.append("write_many")
            raise RuntimeError("the follow-up is down")

    orders = [make_order() for _ in range(3)]
    messages = [payment(o) for o in orders]
    failing = Failing()
    running.register_follow_up(failing)
    try:
        # The chunk rolls back and goes one message at a time: each fails alone, kept.
        assert consume_batch(messages, consumer="payments") == [Outcome.FAILED] * 3
    finally:
        running._follow_ups.remove(failing)
    assert calls == ["write_many", "write", "write", "write"]
    for order in orders:
        order.refresh_from_db()
        assert (order.status, order.version) == (OrderStatus.PENDING_PAYMENT, 0)
    rows = ProcessedMessage.objects.filter(consumer="payments")
    assert sorted(rows.values_list("status", flat=True)) == ["failed"] * 3
    assert all("the follow-up is down" in e for e in rows.values_list("error", flat=True))
    # Delivered again once the follow-up works: applied, each once.
    assert consume_batch(messages, consumer="payments") == [Outcome.APPLIED] * 3
    versions = Order.objects.filter(pk__in=[o.pk for o in orders]).values_list("version", flat=True)
    assert set(versions) == {1}


# -- The one-statement road: the follow-up's row written by the statement itself ---------


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_one_statement_writes_the_follow_ups_row_one_by_one_would_write(
    make_order, monkeypatch
) -> None:
    handed_over = [make_order() for _ in range(3)]
    one_by_one = [make_order() for _ in range(3)]
    outbox_table = OutboxMessage._meta.db_table
    inbox_partitioned()  # read once per process, not the message's own statement
    with _fulfil(), tracing.use(TRACE, "single-3"):
        for order in handed_over:
            with CaptureQueriesContext(connection) as queries:
                assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
            # (The Bloom filter's warm-up reads the inbox too; not the message's own.)
            statements = [q["sql"] for q in queries if not q["sql"].startswith("DECLARE")]
            # One statement in autocommit: no BEGIN/COMMIT, no outbox INSERT of its own.
            assert len(statements) == 1, statements
            assert statements[0].startswith("WITH claim")
            assert outbox_table in statements[0]
        # A follow-up without outbox_row: the statement in its transaction, then its INSERT.
        monkeypatch.delattr(QueueFulfilment, "outbox_row")
        for order in one_by_one:
            with CaptureQueriesContext(connection) as queries:
                assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
            inserts = [q for q in queries if q["sql"].startswith("INSERT")]
            assert len(inserts) == 1
            assert outbox_table in inserts[0]["sql"]
    written = _rows(handed_over)
    assert written == _rows(one_by_one)
    assert len(written) == 3
    assert (written[0][-2], written[0][-1]) == (TRACE, "single-3")
    for order in handed_over:
        order.refresh_from_db()
        assert (order.status, order.version) == (OrderStatus.PAID, 1)
    # Delivered again: duplicates, nothing written twice.
    for order in handed_over:
        assert consume_message(payment(order), consumer="payments") is not Outcome.APPLIED
    assert len(_rows(handed_over)) == 3


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_one_statement_publishes_its_row_after_commit_and_never_a_queued_one(
    make_order, monkeypatch
) -> None:
    published: list[list[int]] = []
    real = relay.relay_outbox

    def record(*, ids: list[int] | None = None, **kwargs: Any) -> Any:
        published.append(list(ids or []))
        return real(ids=ids, **kwargs)

    monkeypatch.setattr(relay, "relay_outbox", record)
    fresh, queued = make_order(), make_order()
    producer.publish_on_commit(
        "idempotent_orders.fulfil_order", "by hand", message_id=f"fulfil-{queued.pk}"
    )
    published.clear()
    with _fulfil(OUTBOX_PUBLISH_ON_COMMIT=True, OUTBOX_PUBLISHER_THREAD=False):
        assert consume_message(payment(fresh), consumer="payments") is Outcome.APPLIED
        assert consume_message(payment(queued), consumer="payments") is Outcome.APPLIED
    row = OutboxMessage.objects.get(message_id=f"fulfil-{fresh.pk}")
    assert published == [[row.pk]]
    assert row.status == "sent"
    # The row queued already is the message: unchanged, not published again.
    assert OutboxMessage.objects.get(message_id=f"fulfil-{queued.pk}").payload == "by hand"
    assert OutboxMessage.objects.count() == 2
