"""The road one statement at a time, on every database: a message the roads without a
read decline (a guard the order failed, a caller's transaction, a follow-up that writes
its own rows, a road switched off) is claimed, read, run and written in one transaction
of Django's ``atomic``; a race lost between the read and the write rolls all of it back
and decides again."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from idempotent_orders.consuming import single, writing
from idempotent_orders.consuming.backends import Backend, backend
from idempotent_orders.models import (
    Order,
    OrderStatus,
    OutboxMessage,
    Outcome,
    ProcessedMessage,
    SpentPayment,
)
from tests.support.messages import payment, shipment, transitions_heard
from tests.support.threads import after_the_read, elsewhere

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def read_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every road without a read declines, and no backend sends two texts: the message is
    claimed, its order read and written one statement at a time."""
    monkeypatch.setattr(Backend, "roads_without_read", lambda self: [])
    monkeypatch.setattr(Backend, "texts", lambda self: None)


def _paid(make_order: Any) -> Order:
    order = make_order()
    Order.objects.filter(pk=order.pk).update(status=OrderStatus.PAID, payment_id=f"pay-{order.pk}")
    return Order.objects.get(pk=order.pk)


# The order is read after the claim and written optimistically on PostgreSQL; MariaDB
# locks it with the read, and SQLite's transaction holds the write lock from the claim on:
# another writer waits there, and no race is lost.
@pytest.mark.backends("postgresql")
def test_an_order_moved_after_the_read_rolls_everything_back_and_decides_again(
    make_order, fulfil: None, read_first: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    order = make_order()
    versions = after_the_read(
        monkeypatch,
        lambda: Order.objects.filter(pk=order.pk).update(version=F("version") + 1),
    )
    message = payment(order)
    assert single.consume_message(message, consumer="payments") is Outcome.APPLIED
    assert versions == [0, 1]  # the first transaction was undone; the second read v1
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version) == (OrderStatus.PAID, 2)
    assert ProcessedMessage.objects.filter(message_id=message["message_id"]).count() == 1
    assert list(SpentPayment.objects.values_list("payment_id", "order_id")) == [
        (f"pay-{order.pk}", order.pk)
    ]
    assert OutboxMessage.objects.filter(message_id=f"fulfil-{order.pk}").count() == 1


@pytest.mark.backends("postgresql")
def test_a_transition_of_several_sources_that_loses_a_race_decides_again(
    make_order, read_first: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``ship`` leaves PAID or PROCESSING: the state as read is the source the write tests.
    order = _paid(make_order)
    versions = after_the_read(
        monkeypatch,
        lambda: Order.objects.filter(pk=order.pk).update(
            status=OrderStatus.PROCESSING, version=F("version") + 1
        ),
    )
    message = shipment(order)
    with transitions_heard() as heard:
        assert single.consume_message(message, consumer="shipping") is Outcome.APPLIED
    assert versions == [0, 1]
    assert heard == [(order.pk, OrderStatus.SHIPPED, 2, OrderStatus.PROCESSING)]
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version, row.tracking_number) == (
        OrderStatus.SHIPPED,
        2,
        f"TRK{order.pk}",
    )
    assert ProcessedMessage.objects.filter(message_id=message["message_id"]).count() == 1


def test_a_claim_that_loses_to_the_inbox_writes_nothing(
    make_order, fulfil: None, read_first: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    order = make_order()
    message = payment(order)
    real = single.apply

    def overtaken(*args: Any, **kwargs: Any) -> Any:
        # Another delivery of the same message commits its claim before ours.
        elsewhere(
            lambda: ProcessedMessage.objects.create(
                consumer="payments", message_id=message["message_id"], outcome=Outcome.APPLIED
            )
        )
        return real(*args, **kwargs)

    monkeypatch.setattr(single, "apply", overtaken)
    assert single.consume_message(message, consumer="payments") is Outcome.DUPLICATE
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version, row.payment_id) == (OrderStatus.PENDING_PAYMENT, 0, "")
    assert not SpentPayment.objects.exists()
    assert not OutboxMessage.objects.exists()


def test_a_message_the_roads_without_a_read_decline_is_a_read_and_one_transaction(
    make_order, read_first: None
) -> None:
    """A dispatch (two sources) the roads without a read decline: the claim, the order's
    read (MariaDB: the read, locked, then the claim) and the conditional UPDATE in
    Django's ``atomic``; no statement of a road without a read is sent."""
    single.consume_message(shipment(_paid(make_order)), consumer="shipping")  # first statements
    order = _paid(make_order)
    with CaptureQueriesContext(connection) as queries:
        assert single.consume_message(shipment(order), consumer="shipping") is Outcome.APPLIED
    sql = [q["sql"] for q in queries.captured_queries]
    kinds = [s.split(" ", 1)[0] for s in sql]
    qn = connection.ops.quote_name
    reads = [s for s in sql if s.startswith(f"SELECT {qn(Order._meta.db_table)}.")]
    assert len(reads) == 1, sql
    assert reads[0].endswith(" FOR UPDATE") == backend().locks_orders_first, sql
    inserts = [s for s in sql if s.startswith("INSERT INTO")]
    assert len(inserts) == 1, sql
    assert ProcessedMessage._meta.db_table in inserts[0], sql
    updates = [s for s in sql if s.startswith(f"UPDATE {qn(Order._meta.db_table)}")]
    assert len(updates) == 1, sql
    assert not any(s.startswith(("WITH", "START TRANSACTION")) for s in sql), sql
    # Five round trips: BEGIN, the claim and the read (MariaDB: the read first), the
    # UPDATE and COMMIT.
    first = ["SELECT", "INSERT"] if backend().locks_orders_first else ["INSERT", "SELECT"]
    assert kinds == ["BEGIN", *first, "UPDATE", "COMMIT"], sql
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version) == (OrderStatus.SHIPPED, 1)


@pytest.mark.backends("mysql")
def test_two_payments_of_one_order_in_callers_transactions_meet_no_deadlock(
    make_order, read_first: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On MariaDB the order is read ``FOR UPDATE`` before the claim: a second payment of the
    same order waits for the first to commit, then decides against what it wrote. Were the
    inbox row's foreign key to share-lock the order first, two claims would hold it and
    their UPDATEs cross: a deadlock, and MariaDB rolls the caller's transaction back."""
    order = make_order()
    first_claimed, second_claimed = threading.Event(), threading.Event()
    real_claim, real_call = writing._claim, writing.call_transition

    def claim(*args: Any, **kwargs: Any) -> Any:
        done = real_claim(*args, **kwargs)
        name = threading.current_thread().name
        (first_claimed if name == "first" else second_claimed).set()
        return done

    def call(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "first":
            # Give the second payment every chance to claim before this one writes.
            second_claimed.wait(2)
        return real_call(*args, **kwargs)

    monkeypatch.setattr(writing, "_claim", claim)
    monkeypatch.setattr(writing, "call_transition", call)
    outcomes: dict[str, Any] = {}

    def pay(name: str) -> None:
        message = payment(order, payment_id=f"{name}-{order.pk}")
        message["message_id"] = f"{name}-{order.pk}"
        try:
            with transaction.atomic():
                outcomes[name] = single.consume_message(message, consumer="payments")
        except Exception as exc:  # what the caller would meet
            outcomes[name] = exc
        finally:
            connection.close()

    first = threading.Thread(target=pay, args=("first",), name="first")
    second = threading.Thread(target=pay, args=("second",), name="second")
    first.start()
    assert first_claimed.wait(30)  # the first has read the order, then claimed
    second.start()
    first.join(30)
    second.join(30)
    assert outcomes == {"first": Outcome.APPLIED, "second": Outcome.REJECTED}
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version, row.payment_id) == (OrderStatus.PAID, 1, f"first-{order.pk}")
