"""MariaDB and SQLite: a message's writes go as one transaction of their own, before its
order is read.

The claim, the spent payment, the UPDATE with the decision's tests and the follow-up's
outbox row are sent together (one multi-statement text on MariaDB; the driver's statements
between BEGIN and COMMIT on SQLite), and anything that would not apply rolls all of it back
and leaves the message to the road after the read (``tests/consume/test_after_read.py``).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext, override_settings
from django_fsm.signals import pre_transition

from idempotent_orders.consuming.backends import at_once, backend
from idempotent_orders.consuming.backends.mysql import MySQL
from idempotent_orders.consuming.backends.sqlite import SQLite
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import (
    Order,
    OrderStatus,
    OutboxMessage,
    Outcome,
    ProcessedMessage,
    SpentPayment,
)
from tests.support.messages import payment, shipment, transitions_heard

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.backends("sqlite", "mysql")]

INBOX = ProcessedMessage._meta.db_table


def _statements(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries]


def test_a_new_payment_and_its_follow_up_are_one_transaction(make_order, fulfil: None) -> None:
    consume_message(payment(make_order()), consumer="payments")  # loads the Bloom filter
    OutboxMessage.objects.all().delete()
    order = make_order()
    with transitions_heard() as heard, CaptureQueriesContext(connection) as queries:
        assert consume_message(payment(order, seq=1), consumer="payments") is Outcome.APPLIED
    sql = _statements(queries)
    assert not any("SAVEPOINT" in s for s in sql), sql
    if connection.vendor == "mysql":
        # One text and no read first: the transaction, its writes with the decision's
        # tests in the UPDATE, the order as written, and COMMIT (one round trip).
        assert len(sql) == 1, sql
        assert sql[0].startswith("START TRANSACTION; INSERT INTO `idempotent_orders_process")
        assert "BINARY `status` = 'pending_payment'" in sql[0]
        assert sql[0].endswith("; COMMIT")
    else:
        # No read first: the transaction, its writes with the decision's tests in the
        # UPDATE, the order as written (a receiver hears the transition), and COMMIT.
        assert [s.split(" ", 2)[:2] for s in sql] == [
            ["BEGIN", "IMMEDIATE"],
            ["INSERT", "INTO"],
            ["INSERT", "INTO"],
            ["UPDATE", '"idempotent_orders_order"'],
            ["SELECT", '"idempotent_orders_order"."id",'],
            ["INSERT", "INTO"],
            ["COMMIT"],
        ]
        assert "\"status\" = 'pending_payment' COLLATE BINARY" in sql[3]
    assert heard == [(order.pk, OrderStatus.PAID, 1, OrderStatus.PENDING_PAYMENT)]
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version, row.last_seq, row.payment_id) == (
        OrderStatus.PAID,
        1,
        1,
        f"pay-{order.pk}",
    )
    inbox = ProcessedMessage.objects.get(order_id=order.pk)
    assert (inbox.outcome, inbox.status, inbox.seq, inbox.attempts) == (
        Outcome.APPLIED,
        "done",
        1,
        1,
    )
    assert inbox.created_at is not None
    assert list(
        SpentPayment.objects.filter(order_id=order.pk).values_list("payment_id", "order_id")
    ) == [(f"pay-{order.pk}", order.pk)]
    queued = OutboxMessage.objects.get()
    assert (queued.message_id, queued.task_name, queued.payload, queued.status) == (
        f"fulfil-{order.pk}",
        "idempotent_orders.fulfil_order",
        order.pk,
        "pending",
    )
    assert (queued.options, queued.order_key, queued.attempts) == ({}, None, 0)
    assert queued.created_at is not None
    assert queued.available_at is not None


def test_the_order_is_read_back_only_for_a_receiver(make_order, fulfil: None) -> None:
    consume_message(payment(make_order()), consumer="payments")  # loads the Bloom filter
    order = make_order()
    with CaptureQueriesContext(connection) as queries:
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    table = Order._meta.db_table
    reads = [s for s in " ; ".join(_statements(queries)).split(";") if f"FROM `{table}`" in s]
    reads += [s for s in _statements(queries) if f'FROM "{table}"' in s]
    assert reads == []  # nobody hears the transition: the writes alone
    assert Order.objects.get(pk=order.pk).status == OrderStatus.PAID
    assert OutboxMessage.objects.filter(message_id=f"fulfil-{order.pk}").count() == 1


def test_the_follow_up_is_published_after_the_commit(make_order) -> None:
    config = {**settings.IDEMPOTENT_ORDERS, "FULFIL_AFTER_PAYMENT": True}
    handed: list[tuple[str, int]] = []
    with (
        override_settings(IDEMPOTENT_ORDERS=config),
        pytest.MonkeyPatch.context() as patch,
    ):
        from idempotent_orders.outbox import producer

        def submitted(pk: int, db: str, keyed: bool = False) -> None:
            # Called after the commit: another connection sees the row.
            assert not connection.in_atomic_block
            handed.append((db, pk))

        patch.setattr(producer, "_publish_after_commit", submitted)
        order = make_order()
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    row = OutboxMessage.objects.get(message_id=f"fulfil-{order.pk}")
    assert handed == [("default", row.pk)]


def test_a_spent_payment_rolls_the_claim_back_and_is_money_to_give_back(
    make_order, fulfil: None
) -> None:
    order, other = make_order(), make_order()
    assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    # The same charge on another order: rejected, the order untouched, nothing queued.
    again = payment(other, payment_id=f"pay-{order.pk}")
    assert consume_message(again, consumer="payments") is Outcome.REJECTED
    row = ProcessedMessage.objects.get(message_id=again["message_id"])
    assert row.error.startswith(f"payment pay-{order.pk} already paid order {order.pk}")
    other.refresh_from_db()
    assert (other.status, other.version) == (OrderStatus.PENDING_PAYMENT, 0)
    # The same charge for its own order under a new message id: a duplicate.
    repeat = payment(order)
    assert consume_message(repeat, consumer="payments") is Outcome.DUPLICATE
    assert SpentPayment.objects.count() == 1
    assert list(OutboxMessage.objects.values_list("message_id", flat=True)) == [
        f"fulfil-{order.pk}"
    ]


def test_a_follow_up_queued_already_is_not_queued_twice(make_order, fulfil: None) -> None:
    order = make_order()
    OutboxMessage.objects.create(
        message_id=f"fulfil-{order.pk}", task_name="idempotent_orders.fulfil_order", payload=1
    )
    assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    assert OutboxMessage.objects.filter(message_id=f"fulfil-{order.pk}").count() == 1
    assert Order.objects.get(pk=order.pk).status == OrderStatus.PAID


def test_only_a_follow_up_queued_now_is_handed_to_the_publisher(
    make_order, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idempotent_orders.outbox import producer

    handed: list[int] = []
    monkeypatch.setattr(
        producer, "_publish_after_commit", lambda pk, db, keyed=False: handed.append(pk)
    )
    earlier, order = make_order(), make_order()
    OutboxMessage.objects.create(
        message_id=f"fulfil-{earlier.pk}", task_name="idempotent_orders.fulfil_order", payload=1
    )
    config = {**settings.IDEMPOTENT_ORDERS, "FULFIL_AFTER_PAYMENT": True}
    with override_settings(IDEMPOTENT_ORDERS=config):
        assert consume_message(payment(earlier), consumer="payments") is Outcome.APPLIED
        assert handed == []  # the row there already is not the message's to publish
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    assert handed == [OutboxMessage.objects.get(message_id=f"fulfil-{order.pk}").pk]


def _receiver(sender: Any, **kwargs: Any) -> None:
    """A pre_transition receiver: it may write in the transaction."""


def test_a_receiver_or_a_callers_transaction_takes_the_atomic_road(make_order) -> None:
    order = make_order()
    pre_transition.connect(_receiver, sender=Order)
    try:
        with CaptureQueriesContext(connection) as queries:
            assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    finally:
        pre_transition.disconnect(_receiver, sender=Order)
    # Not at_once's one transaction (the claim first); on MariaDB the road's two
    # texts (the order's read first), on SQLite the road after the read.
    sent = _statements(queries)
    assert not any(s.startswith("START TRANSACTION; INSERT") for s in sent)
    two_texts = [s for s in sent if s.startswith("START TRANSACTION; SELECT ")]
    assert len(two_texts) == (1 if connection.vendor == "mysql" else 0)
    other = make_order()
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        assert not at_once.can_apply_unread_at_once()
        assert consume_message(payment(other), consumer="payments") is Outcome.APPLIED
    assert not any(s.startswith("START TRANSACTION") for s in _statements(queries))
    assert Order.objects.get(pk=other.pk).status == OrderStatus.PAID


@pytest.mark.parametrize(
    ("change", "message", "outcome", "tried"),
    [
        ({"amount": Decimal("99.00")}, {}, Outcome.REJECTED, True),
        # An amount of more places than the column's never equals it: not even tried.
        ({}, {"payload": {"amount": "12.501"}}, Outcome.REJECTED, False),
        ({}, {"payload": {"amount": "12.5" + "0" * 70 + "1"}}, Outcome.REJECTED, False),
        ({}, {"payload": {"amount": "12.500"}}, Outcome.APPLIED, True),
        ({"currency": "EUR"}, {}, Outcome.REJECTED, True),
        ({"currency": "cny"}, {}, Outcome.REJECTED, True),
        ({"payment_id": "someone-else"}, {}, Outcome.REJECTED, True),
        ({"status": OrderStatus.PAID}, {}, Outcome.DUPLICATE, True),
        ({"last_seq": 3}, {"seq": 2}, Outcome.STALE, True),
        ({}, {"seq": 5}, Outcome.PARKED, True),
    ],
)
def test_the_decision_is_tested_in_the_update_and_a_refused_order_is_left_alone(
    make_order,
    fulfil: None,
    change: dict[str, Any],
    message: dict[str, Any],
    outcome: Outcome,
    tried: bool,
) -> None:
    order = make_order()
    Order.objects.filter(pk=order.pk).update(**change)
    before = Order.objects.get(pk=order.pk)
    sent = payment(order)
    sent = {**sent, **message, "payload": {**sent["payload"], **message.get("payload", {})}}
    consume_message(payment(make_order()), consumer="payments")  # loads the Bloom filter
    OutboxMessage.objects.all().delete()
    chosen = type(backend())
    real = chosen.send_at_once
    sends: list[int] = []

    def counted(self: Any, conn: Any, statements: Any, read: Any) -> Any:
        sends.append(len(statements))
        return real(self, conn, statements, read)

    with (
        mock.patch.object(chosen, "send_at_once", counted),
        CaptureQueriesContext(connection) as queries,
    ):
        assert consume_message(sent, consumer="payments") is outcome
    sql = _statements(queries)
    assert bool(sends) is tried
    after = Order.objects.get(pk=order.pk)
    inbox = ProcessedMessage.objects.get(order_id=order.pk)
    assert inbox.outcome == outcome
    if outcome is Outcome.APPLIED:
        # MariaDB: one text; SQLite: no read before the transaction, nor after it.
        assert len(sql) == 1 if connection.vendor == "mysql" else sql[-1] == "COMMIT", sql
        assert (after.status, after.version) == (OrderStatus.PAID, 1)
        return
    # Undone, then read and decided as usual.
    read = f"SELECT {connection.ops.quote_name('idempotent_orders_order')}"
    assert any(s.startswith(read) for s in sql[1 if tried else 0 :]), sql
    assert (after.status, after.version, after.payment_id) == (
        before.status,
        before.version,
        before.payment_id,
    )
    assert not OutboxMessage.objects.exists()
    assert SpentPayment.objects.filter(order_id=order.pk).exists() is False


def test_a_connection_out_of_autocommit_is_never_sent_a_transaction_of_its_own() -> None:
    # A transaction may be open (AUTOCOMMIT off): START TRANSACTION would commit it.
    assert at_once.can_apply_unread_at_once()
    transaction.set_autocommit(False)
    try:
        assert not at_once.can_apply_unread_at_once()
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)


def test_sqlite_tests_a_decimal_only_where_a_double_tells_its_values_apart() -> None:
    # SQLite compares a decimal column as a double: beyond 15 digits two amounts of one
    # scale may be one double, and the usual road (Decimal in Python) must say it.
    from django.db.models import DecimalField

    wide = DecimalField(max_digits=20, decimal_places=2)
    narrow = DecimalField(max_digits=15, decimal_places=2)
    amount = Decimal("12345678901234567.01")
    sqlite = SQLite.exact_decimal_digits
    assert at_once._test_value(wide, amount, sqlite) is None
    assert at_once._test_value(wide, amount, MySQL.exact_decimal_digits) == amount
    assert at_once._test_value(narrow, Decimal("12.5"), sqlite) == Decimal("12.50")


def _in(order: Order, status: str) -> Order:
    Order.objects.filter(pk=order.pk).update(status=status)
    return Order.objects.get(pk=order.pk)


@pytest.mark.parametrize("source", [OrderStatus.PAID, OrderStatus.PROCESSING])
def test_a_transition_of_two_sources_applies_from_each_without_a_read(
    make_order, source: str
) -> None:
    """``ship`` leaves PAID or PROCESSING: the UPDATE tests both; the state the order
    left is read in the same transaction, before the UPDATE, for the receiver."""
    consume_message(payment(make_order()), consumer="payments")  # loads the Bloom filter
    quiet, heard_order = _in(make_order(), source), _in(make_order(), source)
    table = connection.ops.quote_name(Order._meta.db_table)
    with CaptureQueriesContext(connection) as queries:
        assert consume_message(shipment(quiet), consumer="shipping") is Outcome.APPLIED
    sql = _statements(queries)
    # Nobody hears it: the writes alone, no read of the order.
    assert not any(f"FROM {table}" in s for s in " ; ".join(sql).split(";")), sql
    with transitions_heard() as heard, CaptureQueriesContext(connection) as queries:
        assert consume_message(shipment(heard_order), consumer="shipping") is Outcome.APPLIED
    sql = _statements(queries)
    if connection.vendor == "mysql":
        assert len(sql) == 1, sql  # one text, one round trip
        assert sql[0].startswith("START TRANSACTION; INSERT INTO `idempotent_orders_process")
        assert "FOR UPDATE; UPDATE `idempotent_orders_order`" in sql[0], sql
        assert "(BINARY `status` = 'paid' OR BINARY `status` = 'processing')" in sql[0]
        assert sql[0].endswith("; COMMIT")
    else:
        assert [s.split(" ", 2)[:2] for s in sql] == [
            ["BEGIN", "IMMEDIATE"],
            ["INSERT", "INTO"],
            ["SELECT", '"status"'],
            ["UPDATE", table],
            ["SELECT", f'{table}."id",'],
            ["COMMIT"],
        ], sql
        assert "(\"status\" = 'paid' COLLATE BINARY OR" in sql[3]
    assert heard == [(heard_order.pk, OrderStatus.SHIPPED, 1, source)]
    for order in (quiet, heard_order):
        row = Order.objects.get(pk=order.pk)
        assert (row.status, row.version, row.tracking_number) == (
            OrderStatus.SHIPPED,
            1,
            f"TRK{order.pk}",
        )
        inbox = ProcessedMessage.objects.get(order_id=order.pk)
        assert (inbox.outcome, inbox.status) == (Outcome.APPLIED, "done")


def test_a_transition_of_two_sources_hears_the_source_the_update_left(
    make_order, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer moves the order from one source to the other just before the
    transaction: the receiver hears the state the UPDATE left, not an older one."""
    order = _in(make_order(), OrderStatus.PAID)
    runs: list[int] = []
    real = type(backend()).send_at_once

    def moved(*args: Any, **kwargs: Any) -> Any:
        runs.append(1)
        Order.objects.filter(pk=order.pk).update(status=OrderStatus.PROCESSING)
        return real(*args, **kwargs)

    monkeypatch.setattr(type(backend()), "send_at_once", moved)
    with transitions_heard() as heard:
        assert consume_message(shipment(order), consumer="shipping") is Outcome.APPLIED
    assert runs == [1]
    assert heard == [(order.pk, OrderStatus.SHIPPED, 1, OrderStatus.PROCESSING)]


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(OrderStatus.SHIPPED, Outcome.DUPLICATE), (OrderStatus.PENDING_PAYMENT, Outcome.PARKED)],
)
def test_a_transition_of_two_sources_from_neither_is_left_to_the_read(
    make_order, status: str, outcome: Outcome
) -> None:
    consume_message(payment(make_order()), consumer="payments")  # loads the Bloom filter
    order = _in(make_order(), status)
    message = shipment(order)
    with CaptureQueriesContext(connection) as queries:
        assert consume_message(message, consumer="shipping") is outcome
    sql = _statements(queries)
    begin = "START TRANSACTION" if connection.vendor == "mysql" else "BEGIN"
    assert sql[0].startswith(begin)  # tried first, rolled back
    read = f"SELECT {connection.ops.quote_name(Order._meta.db_table)}"
    assert any(s.startswith(read) for s in sql[1:]), sql
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version) == (status, 0)
    inbox = ProcessedMessage.objects.get(consumer="shipping", message_id=message["message_id"])
    assert inbox.outcome == outcome


def test_a_transition_of_two_sources_delivered_twice_applies_once(make_order) -> None:
    order = _in(make_order(), OrderStatus.PROCESSING)
    message = shipment(order)
    assert consume_message(message, consumer="shipping") is Outcome.APPLIED
    assert consume_message(message, consumer="shipping") is Outcome.DUPLICATE
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version) == (OrderStatus.SHIPPED, 1)
    assert ProcessedMessage.objects.filter(message_id=message["message_id"]).count() == 1
