"""The save() road's UPDATE held back for the next text (PostgreSQL, MariaDB): ``save()`` is
told the row was written, and its guarded UPDATE goes at the head of the project's next
statement or of the road's last text. The project's code sees the row as written; an
UPDATE that matched no row (another writer moved the order after the read) rolls the
message back whole, and the road decides again, with no exception reaching the project's
code."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import F
from django.db.models.signals import post_save, pre_save
from django.test.utils import CaptureQueriesContext, override_settings

from idempotent_orders.consuming.failures import MessageFailed
from idempotent_orders.consuming.running import road
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import (
    InboxStatus,
    Order,
    OrderStatus,
    OutboxMessage,
    Outcome,
    ProcessedMessage,
    SpentPayment,
)
from tests.support.messages import payment
from tests.support.round_trips import round_trips
from tests.support.threads import after_the_read

pytestmark = [
    pytest.mark.backends("postgresql", "mysql"),
    pytest.mark.django_db(transaction=True),
]


@contextmanager
def _receiver(receiver: Callable[..., Any]) -> Iterator[None]:
    """``receiver`` on Order's ``post_save``: the model takes the save() road."""
    post_save.connect(receiver, sender=Order, weak=False, dispatch_uid="test-held-update")
    try:
        assert road(Order, "pay")[0] == "save"
        yield
    finally:
        post_save.disconnect(sender=Order, dispatch_uid="test-held-update")


@contextmanager
def _moved_before_save(moving: bool = True) -> Iterator[list[int]]:
    """The project's own ``pre_save`` receiver moves the order on (a new version) in the
    message's transaction, once; yields the rows each move updated."""
    moves: list[int] = []

    def move_on(sender: Any, instance: Any, **kwargs: Any) -> None:
        if moving and not moves:
            moves.append(Order.objects.filter(pk=instance.pk).update(version=F("version") + 1))

    pre_save.connect(move_on, sender=Order, weak=False, dispatch_uid="test-held-move")
    try:
        yield moves
    finally:
        pre_save.disconnect(sender=Order, dispatch_uid="test-held-move")


def _quiet(sender: Any, **kwargs: Any) -> None:
    """A receiver that sends nothing."""


@contextmanager
def _config(fulfil: bool) -> Iterator[None]:
    config = {
        **settings.IDEMPOTENT_ORDERS,
        "FULFIL_AFTER_PAYMENT": fulfil,
        "OUTBOX_PUBLISH_ON_COMMIT": False,
    }
    with override_settings(IDEMPOTENT_ORDERS=config):
        yield


def _applied_once(order: Order, message: dict[str, Any], version: int, fulfil: bool) -> None:
    row = Order.objects.get(pk=order.pk)
    paid = (OrderStatus.PAID, version, f"pay-{order.pk}")
    assert (row.status, row.version, row.payment_id) == paid
    inbox = ProcessedMessage.objects.get(message_id=message["message_id"])
    assert (inbox.outcome, inbox.order_id) == (Outcome.APPLIED, order.pk)
    spent = SpentPayment.objects.filter(order_id=order.pk).values_list("payment_id", flat=True)
    assert list(spent) == [f"pay-{order.pk}"]
    queued = OutboxMessage.objects.filter(message_id=f"fulfil-{order.pk}").count()
    assert queued == (1 if fulfil else 0)


@pytest.mark.parametrize("fulfil", [False, True], ids=["no-follow-up", "outbox-row"])
def test_a_receiver_reads_the_row_as_written_and_the_update_rides_its_text(
    make_order, fulfil: bool
) -> None:
    """The receiver's read-back goes in one text after the held UPDATE and sees the order
    written; without a receiver statement the UPDATE rides the last text (two round trips
    in all with a follow-up)."""
    seen: list[tuple[str, int]] = []

    def read_back(sender: Any, instance: Any, **kwargs: Any) -> None:
        seen.append(Order.objects.values_list("status", "version").get(pk=instance.pk))

    with _config(fulfil):
        assert consume_message(payment(make_order()), consumer="payments") is Outcome.APPLIED
        reading, quiet = make_order(), make_order()
        texts: list[str] = []
        with _receiver(read_back), round_trips(texts) as trips:
            message = payment(reading)
            assert consume_message(message, consumer="payments") is Outcome.APPLIED
            reading_trips = trips()
        quiet_texts: list[str] = []
        with _receiver(_quiet), round_trips(quiet_texts) as trips:
            quiet_message = payment(quiet)
            assert consume_message(quiet_message, consumer="payments") is Outcome.APPLIED
            quiet_trips = trips()
    assert seen == [(OrderStatus.PAID, 1)]
    table = connection.ops.quote_name(Order._meta.db_table)
    assert reading_trips == 3  # the claim and read; the UPDATE with the receiver's read; the end
    if connection.vendor == "postgresql":
        assert texts[1].startswith(f'"WITH moved AS (UPDATE {table} SET ')
        assert "SELECT count(*) FROM moved; SELECT " in texts[1]  # then the receiver's read
    else:
        assert texts[1].startswith(f"UPDATE {table} SET "), texts
        assert f"; SELECT {table}." in texts[1]
    if fulfil:
        assert quiet_trips == 2  # the claim and read; the UPDATE, the outbox row and COMMIT
        assert quiet_texts[1].rstrip('"').endswith("; COMMIT")
        assert "UPDATE " in quiet_texts[1]
    else:
        assert quiet_trips == 3  # nothing after the UPDATE: it goes alone, then COMMIT
    _applied_once(reading, message, 1, fulfil)
    _applied_once(quiet, quiet_message, 1, fulfil)


_WHERE = pytest.mark.parametrize(
    ("fulfil", "reads"),
    [(True, True), (True, False), (False, False)],
    ids=["receiver-statement", "last-text", "alone"],
)


@pytest.mark.backends("postgresql")  # MariaDB's first text locks the order: no one moves it
@_WHERE
def test_an_order_moved_after_the_read_rolls_the_held_update_back_and_decides_again(
    make_order, monkeypatch: pytest.MonkeyPatch, fulfil: bool, reads: bool
) -> None:
    """Wherever the held UPDATE goes out (before a receiver's statement, in the last text,
    alone), matching no row rolls back the claim, the spent payment, the outbox row and the
    receiver's own writes; no exception reaches the receiver, and the road reads again and
    applies the message once, on the version the other writer left."""
    seen: list[Any] = []

    def receiver(sender: Any, instance: Any, **kwargs: Any) -> None:
        if not reads:
            return
        try:
            seen.append(Order.objects.values_list("status", "version").get(pk=instance.pk))
        except Exception as exc:  # what reached the project's code, if anything
            seen.append(exc)
            raise

    order = make_order()
    with _config(fulfil):
        assert consume_message(payment(make_order()), consumer="payments") is Outcome.APPLIED
        versions = after_the_read(
            monkeypatch, lambda: Order.objects.filter(pk=order.pk).update(version=F("version") + 1)
        )
        message = payment(order)
        with _receiver(receiver):
            assert consume_message(message, consumer="payments") is Outcome.APPLIED
    assert versions == [0, 1]  # the first attempt rolled back; the second read version 1
    if reads:
        # The first attempt's receiver read the row as the other writer left it (the held
        # UPDATE matched nothing); the second's, its own write.
        assert seen == [(OrderStatus.PENDING_PAYMENT, 1), (OrderStatus.PAID, 2)]
    _applied_once(order, message, 2, fulfil)


@_WHERE
def test_an_order_the_projects_code_moved_before_save_rolls_back_and_decides_again(
    make_order, fulfil: bool, reads: bool
) -> None:
    """The same on every database that holds the UPDATE: the project's own ``pre_save``
    receiver moves the order on (a new version) in the message's transaction, once; the
    held UPDATE matches no row, the attempt rolls back with that write, and the road applies
    the message on the order as it is."""
    seen: list[Any] = []

    def receiver(sender: Any, instance: Any, **kwargs: Any) -> None:
        if reads:
            seen.append(Order.objects.values_list("status", "version").get(pk=instance.pk))

    order = make_order()
    with _config(fulfil):
        assert consume_message(payment(make_order()), consumer="payments") is Outcome.APPLIED
        message = payment(order)
        with _moved_before_save() as moves, _receiver(receiver):
            assert consume_message(message, consumer="payments") is Outcome.APPLIED
    assert moves == [1]
    if reads:
        assert seen == [(OrderStatus.PENDING_PAYMENT, 1), (OrderStatus.PAID, 1)]
    _applied_once(order, message, 1, fulfil)


def test_percent_signs_in_the_held_update_and_in_the_receiver_statement(make_order) -> None:
    """The held UPDATE's values are written into the receiver's text: a ``%`` in either
    (a value of the order's, an argument of the receiver's) comes through as it is."""
    counted: list[int] = []

    def receiver(sender: Any, instance: Any, **kwargs: Any) -> None:
        counted.append(Order.objects.filter(payment_id__contains="%s%%").count())

    order = make_order()
    message = payment(order, payment_id=f"pay-%s%%-{order.pk}")
    with _config(False), _receiver(receiver), round_trips(texts := []) as trips:
        assert consume_message(message, consumer="payments") is Outcome.APPLIED
        trips()
    assert counted == [1]
    assert any(text.lstrip('"').startswith(("WITH moved AS (UPDATE", "UPDATE")) for text in texts)
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.payment_id) == (OrderStatus.PAID, f"pay-%s%%-{order.pk}")


@pytest.mark.backends("postgresql")  # the one database with server-side cursors here
def test_a_receiver_on_a_server_side_cursor_reads_after_the_update(make_order) -> None:
    """A named cursor takes one statement: the held UPDATE goes alone just before it."""
    seen: list[tuple[str, int]] = []

    def receiver(sender: Any, instance: Any, **kwargs: Any) -> None:
        rows = Order.objects.filter(pk=instance.pk).values_list("status", "version")
        seen.extend(rows.iterator(chunk_size=10))  # a server-side cursor in a transaction

    order = make_order()
    with _config(False), _receiver(receiver), round_trips(texts := []) as trips:
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
        trips()
    assert seen == [(OrderStatus.PAID, 1)]
    assert any(text.startswith(f'"UPDATE "{Order._meta.db_table}" SET ') for text in texts)


def test_where_statements_are_watched_the_update_goes_at_once(make_order) -> None:
    """Captured queries (as DEBUG or a toolbar) see ``save()``'s UPDATE as it is, at once."""
    order = make_order()
    with _config(True), _receiver(_quiet), CaptureQueriesContext(connection) as captured:
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    updates = [q["sql"] for q in captured.captured_queries if q["sql"].startswith("UPDATE")]
    assert len(updates) == 1
    assert "WITH moved" not in " ".join(q["sql"] for q in captured.captured_queries)
    assert Order.objects.get(pk=order.pk).status == OrderStatus.PAID


@pytest.mark.parametrize("moved", [False, True], ids=["applied", "moved"])
def test_in_a_callers_transaction_the_held_update_ends_with_the_savepoint(
    make_order, moved: bool
) -> None:
    """Inside the project's own transaction the held UPDATE goes in the text that releases
    the message's savepoint; one that matched no row is rolled back to the savepoint, the
    road decides again, and the caller's transaction goes on to commit its own writes."""
    order, other = make_order(), make_order()
    message = payment(order)
    with _config(True):
        assert consume_message(payment(make_order()), consumer="payments") is Outcome.APPLIED
        with _moved_before_save(moved) as moves, _receiver(_quiet), transaction.atomic():
            Order.objects.filter(pk=other.pk).update(currency="EUR")  # the caller's own
            with round_trips(texts := []) as trips:
                assert consume_message(message, consumer="payments") is Outcome.APPLIED
                counted = trips()
    assert moves == ([1] if moved else [])
    if not moved:
        assert counted == 2  # the savepoint, claim and read; the UPDATE, outbox row, release
        assert "RELEASE SAVEPOINT" in texts[-1]
        assert "UPDATE " in texts[-1]
    _applied_once(order, message, 1, True)
    assert Order.objects.get(pk=other.pk).currency == "EUR"


@pytest.mark.backends("mysql")  # InnoDB undoes only the failed statement, not the transaction
def test_a_failed_statement_a_receiver_swallows_still_reports_the_order_moved(make_order) -> None:
    """The held UPDATE's rows are read before the error of the project's statement in the
    same text is raised: a receiver that swallows that error still leaves the order known
    to have moved, and the message is decided again instead of committed unapplied."""
    swallowed: list[str] = []

    def failing(sender: Any, instance: Any, **kwargs: Any) -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("INSERT INTO io_no_such_table VALUES (1)")
        except DatabaseError as exc:
            swallowed.append(type(exc).__name__)

    order = make_order()
    message = payment(order)
    with _config(True), _moved_before_save() as moves, _receiver(failing):
        assert consume_message(message, consumer="payments") is Outcome.APPLIED
    assert moves == [1]
    assert len(swallowed) == 2  # the attempt rolled back, and the one that applied
    _applied_once(order, message, 1, True)


def test_a_held_update_the_database_refuses_is_never_committed_unapplied(make_order) -> None:
    """The held UPDATE itself fails (a value too long for its column) in the text of a
    receiver's statement, and the receiver swallows the error: the message is never
    recorded as applied over an order that was not written. It is kept as failed with
    the database's error, as a ``save()`` the database refuses is."""
    swallowed: list[str] = []

    def too_long(sender: Any, instance: Any, **kwargs: Any) -> None:
        instance.business_key = "k" * 500  # wider than the column: the UPDATE is refused

    def swallowing(sender: Any, instance: Any, **kwargs: Any) -> None:
        try:
            Order.objects.filter(pk=instance.pk).exists()
        except DatabaseError as exc:
            swallowed.append(type(exc).__name__)

    order = make_order()
    message = payment(order)
    pre_save.connect(too_long, sender=Order, weak=False, dispatch_uid="test-held-too-long")
    try:
        with _config(True), _receiver(swallowing), pytest.raises(MessageFailed):
            consume_message(message, consumer="payments")
    finally:
        pre_save.disconnect(sender=Order, dispatch_uid="test-held-too-long")
    assert swallowed  # the receiver's statement carried the refused UPDATE
    row = Order.objects.get(pk=order.pk)
    assert (row.status, row.version) == (OrderStatus.PENDING_PAYMENT, 0)
    # Kept as failed with the database's error, for the operator and the redelivery.
    inbox = ProcessedMessage.objects.get(message_id=message["message_id"])
    assert inbox.status == InboxStatus.FAILED
    assert inbox.outcome != Outcome.APPLIED
    assert "Error(" in inbox.error
    assert not SpentPayment.objects.filter(order_id=order.pk).exists()
