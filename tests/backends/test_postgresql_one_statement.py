"""PostgreSQL: a new message is claimed and applied in one statement, and a lost race undoes it."""

from __future__ import annotations

import re
import threading
import time
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext
from django_fsm.signals import post_transition

from idempotent_orders import prepared
from idempotent_orders.consuming import single, writing
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import Order, OrderStatus, Outcome, ProcessedMessage
from tests.support.messages import payment, shipment, transitions_heard

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.backends("postgresql")]


def test_a_new_message_costs_one_statement(make_order) -> None:
    consume_message(payment(make_order()), consumer="payments")  # loads this process's Bloom filter
    order = make_order()
    with transitions_heard() as moved, CaptureQueriesContext(connection) as queries:
        assert consume_message(payment(order, seq=1), consumer="payments") is Outcome.APPLIED
    sql = [q["sql"] for q in queries.captured_queries]
    assert len(sql) == 1, sql  # no read of the order: the statement tests it
    assert sql[0].startswith("WITH claim AS (INSERT INTO")
    assert moved == [(order.pk, OrderStatus.PAID, 1, OrderStatus.PENDING_PAYMENT)]
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version, row.last_seq, row.payment_id) == (
        OrderStatus.PAID,
        1,
        1,
        f"pay-{order.pk}",
    )
    inbox = ProcessedMessage.objects.get(order_id=order.pk)
    assert (inbox.outcome, inbox.status, inbox.seq) == (Outcome.APPLIED, "done", 1)
    assert inbox.created_at is not None
    assert consume_message(payment(order, seq=1), consumer="payments") in (
        Outcome.STALE,
        Outcome.DUPLICATE,
    )


@pytest.mark.parametrize(
    ("change", "message", "outcome"),
    [
        ({"amount": Decimal("99.00")}, {}, Outcome.REJECTED),
        ({"currency": "EUR"}, {}, Outcome.REJECTED),
        ({"payment_id": "someone-else"}, {}, Outcome.REJECTED),
        ({"status": OrderStatus.PAID}, {}, Outcome.DUPLICATE),
        ({"last_seq": 3}, {"seq": 2}, Outcome.STALE),
        ({}, {"seq": 5}, Outcome.PARKED),
    ],
)
def test_an_order_the_statement_refuses_is_left_alone_and_decided_as_usual(
    make_order, change: dict[str, Any], message: dict[str, Any], outcome: Outcome
) -> None:
    order = make_order()
    Order.objects.filter(pk=order.pk).update(**change)
    before = Order.objects.get(pk=order.pk)
    with CaptureQueriesContext(connection) as queries:
        got = consume_message({**payment(order), **message}, consumer="payments")
    assert got is outcome
    sql = [q["sql"] for q in queries.captured_queries]
    claims = [n for n, s in enumerate(sql) if s.startswith("WITH claim AS (INSERT INTO")]
    reads = [n for n, s in enumerate(sql) if s.startswith('SELECT "idempotent_orders_order"')]
    assert claims
    assert reads
    assert claims[0] < reads[0]  # tried first, undone, then decided
    after = Order.objects.get(pk=order.pk)
    assert (after.status, after.version, after.payment_id) == (
        before.status,
        before.version,
        before.payment_id,
    )
    inbox = ProcessedMessage.objects.get(order_id=order.pk)
    assert inbox.outcome == outcome


def test_an_order_with_parked_messages_takes_the_usual_path_and_releases_them(
    make_order,
) -> None:
    order = make_order()
    assert consume_message(shipment(order, seq=2), consumer="shipping") is Outcome.PARKED
    assert Order.objects.get(pk=order.pk).has_parked
    assert consume_message(payment(order, seq=1), consumer="payments") is Outcome.APPLIED
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.last_seq) == (OrderStatus.SHIPPED, 2)  # the successor went too


def test_a_writer_that_commits_first_is_seen_by_the_statement(make_order) -> None:
    """The tests are checked on the row version the UPDATE locks, not on a snapshot."""
    order = make_order()
    locked, done = threading.Event(), threading.Event()

    def other_writer() -> None:
        try:
            with transaction.atomic():
                Order.objects.filter(pk=order.pk).update(
                    status=OrderStatus.PAID, payment_id="elsewhere", version=F("version") + 1
                )
                locked.set()
                done.wait(5)
                time.sleep(0.3)  # let the consumer block on the row lock
        finally:
            connections.close_all()

    thread = threading.Thread(target=other_writer)
    thread.start()
    assert locked.wait(5)
    done.set()
    outcome = consume_message(payment(order), consumer="payments")
    thread.join()
    assert outcome is Outcome.REJECTED  # paid by another payment: never applied twice
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version, row.payment_id) == (OrderStatus.PAID, 1, "elsewhere")
    assert ProcessedMessage.objects.get(order_id=order.pk).outcome == Outcome.REJECTED


def test_a_copy_of_a_claimed_message_is_a_duplicate_and_writes_nothing(make_order) -> None:
    order = make_order()
    message = payment(order)
    assert consume_message(message, consumer="payments") is Outcome.APPLIED
    fresh = Order.objects.get(pk=order.pk)
    # A copy past the fast path (its memory of the message gone) loses to the unique index.
    with pytest.raises(writing.Duplicate):
        writing.apply(single.parse_envelope(message), "payments", Order)
    assert Order.objects.get(pk=order.pk).version == fresh.version
    assert ProcessedMessage.objects.filter(message_id=message["message_id"]).count() == 1


def test_work_inside_the_transaction_takes_the_general_path(make_order) -> None:
    order = make_order()
    seen: list[str] = []

    def receiver(sender: Any, instance: Any, name: str, **kwargs: Any) -> None:
        seen.append(name)

    post_transition.connect(receiver, sender=Order)
    try:
        with CaptureQueriesContext(connection) as queries:
            consume_message(payment(order), consumer="payments")
    finally:
        post_transition.disconnect(receiver, sender=Order)
    sql = [q["sql"] for q in queries.captured_queries]
    assert seen == ["pay"]
    assert "BEGIN" in sql  # a receiver may write in the transaction: a real one is opened
    assert not any(s.startswith("WITH claim") for s in sql)


class _Recording(prepared._DriverCursor):  # type: ignore[misc,name-defined]
    """The driver's own cursor, recording what it ran."""

    ran: list[str] = []
    #: The prepared statements run with bound arguments (also in ``ran``).
    bound: list[str] = []

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        _Recording.ran.append(query.decode() if isinstance(query, bytes) else str(query))
        return super().execute(query, params, **kwargs)


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What went to the driver: statements run by its cursor, and each prepared statement
    run with bound arguments as ``EXECUTE name('argument', ..., NULL)``."""
    _Recording.ran, _Recording.bound = [], []
    monkeypatch.setattr(prepared, "_DriverCursor", _Recording)
    send = prepared._send_prepared

    def recorded(raw: Any, name: bytes, params: Any) -> Any:
        shown = ["NULL" if p is None else f"'{bytes(p).decode()}'" for p in params]
        _Recording.ran.append(f"EXECUTE {name.decode()}({', '.join(shown)})")
        _Recording.bound.append(_Recording.ran[-1])
        return send(raw, name, params)

    monkeypatch.setattr(prepared, "_send_prepared", recorded)
    return _Recording.ran


@pytest.mark.parametrize(
    ("change", "outcome"),
    [
        ({}, Outcome.APPLIED),
        ({"amount": Decimal("99.00")}, Outcome.REJECTED),  # the statement's division by zero
        ({"status": OrderStatus.PAID}, Outcome.DUPLICATE),
    ],
)
def test_the_statement_goes_to_the_driver_when_nobody_watches_queries(
    make_order, driver: list[str], change: dict[str, Any], outcome: Outcome
) -> None:
    consume_message(payment(make_order()), consumer="payments")  # loads this process's Bloom filter
    consume_message(payment(make_order()), consumer="payments")  # prepares the statement
    order = make_order()
    Order.objects.filter(pk=order.pk).update(**change)
    driver.clear()
    msg = payment(order)
    assert consume_message(msg, consumer="payments") is outcome
    # Prepared by the first message on this connection: now only executed, its
    # arguments bound by the protocol (no EXECUTE text through a cursor).
    assert len(driver) == 1, driver
    assert driver[0].startswith("EXECUTE idempotent_orders_")
    assert driver[0] in _Recording.bound
    inbox = ProcessedMessage.objects.get(order_id=order.pk)
    assert inbox.outcome == outcome
    row = Order.objects.get(pk=order.pk)
    assert row.version == (1 if outcome is Outcome.APPLIED else 0)
    assert consume_message(msg, consumer="payments") is Outcome.DUPLICATE
    assert ProcessedMessage.objects.filter(order_id=order.pk).count() == 1


def test_the_statement_sends_only_what_changes_and_a_value_once(
    make_order, driver: list[str]
) -> None:
    for _ in range(2):  # the second use on this connection prepares it
        consume_message(payment(make_order(), seq=1), consumer="payments")
    order = make_order()
    driver.clear()
    assert consume_message(payment(order, seq=1), consumer="payments") is Outcome.APPLIED
    (execute,) = driver
    assert execute.startswith("EXECUTE idempotent_orders_")
    # The inbox row's fixed columns, source and target are in the prepared text;
    # the payment id, written and tested, is one argument; so is the time.
    assert "'done'" not in execute
    assert "'pending_payment'" not in execute
    assert execute.count(f"'pay-{order.pk}'") == 1
    assert len(re.findall(r"'\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d", execute)) == 1
    row = Order.objects.get(pk=order.pk)
    inbox = ProcessedMessage.objects.get(order_id=order.pk)
    assert (row.status, row.payment_id, row.last_seq) == (OrderStatus.PAID, f"pay-{order.pk}", 1)
    assert (inbox.status, inbox.outcome, inbox.seq, inbox.error) == ("done", "applied", 1, "")
    assert inbox.updated_at == row.updated_at


def test_a_session_that_lost_the_prepared_statement_runs_it_plainly_then_prepares_again(
    make_order, driver: list[str]
) -> None:
    for _ in range(2):  # the second use on this connection prepares it
        consume_message(payment(make_order()), consumer="payments")
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")  # as a pooler's reset or DISCARD ALL would
    first, second = make_order(), make_order()
    driver.clear()
    assert consume_message(payment(first), consumer="payments") is Outcome.APPLIED
    assert [q.split(" ", 1)[0] for q in driver] == ["EXECUTE", "DEALLOCATE", "WITH"]
    driver.clear()
    assert consume_message(payment(second), consumer="payments") is Outcome.APPLIED
    assert [q.split(" ", 1)[0] for q in driver] == ["PREPARE", "EXECUTE"]
    for order in (first, second):
        assert Order.objects.get(pk=order.pk).status == OrderStatus.PAID
        assert ProcessedMessage.objects.filter(order_id=order.pk).count() == 1


def test_a_connection_serving_one_message_never_prepares(make_order, driver: list[str]) -> None:
    consume_message(payment(make_order()), consumer="payments")  # loads the Bloom filter
    for _ in range(2):
        connection.close()  # as after each task with CONN_MAX_AGE=0
        driver.clear()
        assert consume_message(payment(make_order()), consumer="payments") is Outcome.APPLIED
        assert [q.split(" ", 1)[0] for q in driver] == ["WITH"]


def test_execute_wrappers_still_see_the_statement(make_order, driver: list[str]) -> None:
    consume_message(payment(make_order()), consumer="payments")
    order = make_order()
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    driver.clear()
    with connection.execute_wrapper(wrapper):
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    assert [s for s in seen if s.startswith("WITH claim AS")]
    assert driver == []


def test_the_prepared_form_numbers_the_arguments_and_unescapes_percent_signs() -> None:
    form = prepared._prepared_form("SELECT %(a0)s, '100%%', %(a1)s, %(a0)s")
    assert form is not None
    assert form.prepare.endswith(" AS SELECT $1, '100%', $2, $1")
    assert form.execute == f"EXECUTE {form.name}(".encode()
    assert prepared._prepared_form("SELECT '5%'") is None  # run plainly, never prepared


def test_the_shared_statements_are_named_by_role_and_text_and_given_up_after_misses() -> None:
    import psycopg
    from django.db import DatabaseError

    read = prepared.statement("claim_read", "SELECT $1", ["text"])
    assert read.name.startswith("idempotent_orders_claim_read_")
    assert read.prepare == f"PREPARE {read.name} (text) AS SELECT $1"
    # Another text (its types included) is another name; no role: the hash alone.
    assert prepared.statement("claim_read", "SELECT $1", ["bigint"]).name != read.name
    plain = prepared.statement("", "SELECT $1")
    assert re.fullmatch(r"idempotent_orders_[0-9a-f]{24}", plain.name)
    assert plain.prepare == f"PREPARE {plain.name} AS SELECT $1"

    class Raw:  # a driver connection as the bookkeeping sees it: weakly referenced
        pass

    raw = Raw()
    assert not prepared.holds(raw, [read.name])
    prepared.hold(raw, [read.name, plain.name])
    assert prepared.holds(raw, [read.name])
    for _ in range(prepared.MAX_MISSES):
        assert not prepared.gave_up(raw)
        prepared.lose(raw, [read.name])
        assert not prepared.holds(raw, [read.name])
        assert prepared.holds(raw, [plain.name])  # only the lost names are prepared again
    assert prepared.gave_up(raw)

    missing = psycopg.errors.InvalidSqlStatementName("gone")
    duplicate = psycopg.errors.DuplicatePreparedStatement("there")
    wrapped = DatabaseError("gone")
    wrapped.__cause__ = missing  # Django's error, the driver's as its cause
    assert prepared.is_missing(missing)
    assert prepared.is_missing(wrapped)
    assert not prepared.is_missing(duplicate)
    assert prepared.is_duplicate(duplicate)
    assert not prepared.is_duplicate(missing)
