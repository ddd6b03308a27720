"""The default road's round trips: the claim with the spent payment, the follow-up road's
prepared statement, and the publisher batching a steady stream of ids."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.db.models.signals import post_save
from django.test.utils import CaptureQueriesContext, override_settings
from django_fsm.signals import pre_transition

from idempotent_orders import outbox, prepared
from idempotent_orders.consuming import current_message, registry, writing
from idempotent_orders.consuming.envelope import parse_envelope
from idempotent_orders.consuming.failures import MessageFailed
from idempotent_orders.consuming.running import road
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import (
    Order,
    OrderStatus,
    OutboxMessage,
    Outcome,
    ProcessedMessage,
    SpentPayment,
)
from idempotent_orders.outbox import producer
from tests.support.messages import payment, shipment, transitions_heard
from tests.support.round_trips import round_trips


def _receiver(sender: Any, **kwargs: Any) -> None:
    """A pre_transition receiver: the order's transition must be run by its own method."""


@pytest.mark.backends("postgresql")
@pytest.mark.django_db
def test_the_road_one_statement_at_a_time_claims_and_spends_in_one_statement(
    make_order,
) -> None:
    """One statement at a time (the two texts standing aside): the claim and the spent
    payment in one statement, then the order's read, then its UPDATE."""
    pre_transition.connect(_receiver, sender=Order)
    standing_aside = mock.patch.object(writing, "_in_two_texts", _declined)
    standing_aside.start()
    try:
        order, other = make_order(), make_order()
        message = payment(order, payment_id=f"ch-{order.pk}")
        with CaptureQueriesContext(connection) as queries:
            assert consume_message(message, consumer="payments") is Outcome.APPLIED
        sql = [q["sql"] for q in queries]
        spent_table = SpentPayment._meta.db_table
        touching = [i for i, q in enumerate(sql) if spent_table in q]
        assert len(touching) == 1, sql  # no separate spent-payment INSERT
        claim = touching[0]
        assert ProcessedMessage._meta.db_table in sql[claim]
        qn = connection.ops.quote_name
        read = next(
            i for i, q in enumerate(sql) if q.startswith(f"SELECT {qn(Order._meta.db_table)}.")
        )
        update = next(
            i for i, q in enumerate(sql) if q.startswith(f"UPDATE {qn(Order._meta.db_table)}")
        )
        assert claim < read < update, sql
        assert list(SpentPayment.objects.values_list("payment_id", "order_id")) == [
            (f"ch-{order.pk}", order.pk)
        ]
        # The same charge on another order: money to give back, the order untouched.
        again = payment(other, payment_id=f"ch-{order.pk}")
        assert consume_message(again, consumer="payments") is Outcome.REJECTED
        row = ProcessedMessage.objects.get(consumer="payments", message_id=again["message_id"])
        assert row.error.startswith(f"payment ch-{order.pk} already paid order {order.pk}")
        other.refresh_from_db()
        assert other.status == OrderStatus.PENDING_PAYMENT
        # The same charge again for its own order, under a new message id: a duplicate.
        repeat = payment(order, payment_id=f"ch-{order.pk}")
        assert consume_message(repeat, consumer="payments") is Outcome.DUPLICATE
        # The same message again: a duplicate, nothing written twice.
        assert consume_message(message, consumer="payments") is Outcome.DUPLICATE
        assert SpentPayment.objects.count() == 1
        # A payment the order refuses (cancelled): spent with the claim, then taken back.
        refused = make_order()
        Order.objects.filter(pk=refused.pk).update(status=OrderStatus.CANCELLED)
        late = payment(refused, payment_id=f"ch-{refused.pk}")
        assert consume_message(late, consumer="payments") is Outcome.REJECTED
        assert not SpentPayment.objects.filter(payment_id=f"ch-{refused.pk}").exists()
        assert SpentPayment.objects.count() == 1
    finally:
        standing_aside.stop()
        pre_transition.disconnect(_receiver, sender=Order)


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_the_follow_up_road_survives_a_session_that_lost_its_prepared_statement(
    make_order,
) -> None:
    fulfil = {
        **settings.IDEMPOTENT_ORDERS,
        "FULFIL_AFTER_PAYMENT": True,
        "OUTBOX_PUBLISH_ON_COMMIT": False,
    }
    with override_settings(IDEMPOTENT_ORDERS=fulfil):
        orders = [make_order() for _ in range(4)]
        # The first use runs plainly, the second prepares and executes.
        for order in orders[:2]:
            assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
        raw = connection.connection
        session = prepared._sessions[raw]
        assert session.prepared, "the follow-up road's statement was not prepared"
        with connection.cursor() as cursor:
            cursor.execute("DEALLOCATE ALL")  # as a pooler's other server session would be
        # The EXECUTE fails in the transaction: rolled back, and the usual road applies it.
        assert consume_message(payment(orders[2]), consumer="payments") is Outcome.APPLIED
        assert session.misses == 1
        # Prepared again on the next message.
        assert consume_message(payment(orders[3]), consumer="payments") is Outcome.APPLIED
        assert session.prepared
    for order in orders:
        order.refresh_from_db()
        assert order.status == OrderStatus.PAID
        assert order.version == 1
    assert ProcessedMessage.objects.filter(outcome=Outcome.APPLIED).count() == 4
    # Exactly one fulfilment row per order, written with its payment.
    assert sorted(OutboxMessage.objects.values_list("message_id", flat=True)) == sorted(
        f"fulfil-{o.pk}" for o in orders
    )


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_the_follow_up_road_returns_the_order_only_to_a_receiver(make_order) -> None:
    fulfil = {
        **settings.IDEMPOTENT_ORDERS,
        "FULFIL_AFTER_PAYMENT": True,
        "OUTBOX_PUBLISH_ON_COMMIT": False,
    }
    status = Order._meta.get_field("status").column

    def returned(queries: CaptureQueriesContext) -> str:
        """What the statement's UPDATE of the order returns (the outbox INSERT follows it)."""
        (sql,) = [q["sql"] for q in queries if q["sql"].startswith("WITH claim")]
        return sql.split("RETURNING")[-2].split(")")[0]

    with override_settings(IDEMPOTENT_ORDERS=fulfil):
        # Nobody hears order_transitioned: the fulfilment row needs only its own id back.
        alone = make_order()
        with CaptureQueriesContext(connection) as queries:
            assert consume_message(payment(alone), consumer="payments") is Outcome.APPLIED
        assert returned(queries).strip() == "1"
        # A receiver is handed the order as the statement wrote it.
        heard_order = make_order()
        with transitions_heard() as heard, CaptureQueriesContext(connection) as queries:
            assert consume_message(payment(heard_order), consumer="payments") is Outcome.APPLIED
        assert f'"{status}"' in returned(queries)
        assert heard == [(heard_order.pk, OrderStatus.PAID, 1, OrderStatus.PENDING_PAYMENT)]
    for order in (alone, heard_order):
        order.refresh_from_db()
        assert (order.status, order.version) == (OrderStatus.PAID, 1)
    # Each payment's fulfilment row, written by its statement.
    assert sorted(OutboxMessage.objects.values_list("message_id", flat=True)) == sorted(
        f"fulfil-{o.pk}" for o in (alone, heard_order)
    )


def test_the_publisher_batches_ids_that_keep_coming_after_a_batch() -> None:
    class Recording(outbox.Publisher):
        linger = 0.5

    batches: list[list[int]] = []
    done = threading.Event()

    def publish(self: Any, batch: list[tuple[str, int, bool]]) -> bool:
        batches.append([pk for _, pk, _ in batch])
        done.set()
        return True

    publisher = Recording()
    publisher._publish = publish.__get__(publisher)  # type: ignore[method-assign]
    try:
        publisher.submit("default", 1)  # idle: published at once, alone
        assert done.wait(30)
        assert publisher.flush(30)
        for pk in range(2, 7):  # a steady stream, one id after another
            publisher.submit("default", pk)
            time.sleep(0.02)
        assert publisher.flush(30)
    finally:
        publisher._stop()
    assert batches == [[1], [2, 3, 4, 5, 6]]


def _declined(*args: Any, **kwargs: Any) -> None:
    """The two texts standing aside: the road reads, then writes one statement at a time."""
    return None


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("fulfil", [False, True], ids=["no-follow-up", "outbox-row"])
def test_the_save_road_claims_and_reads_in_one_text_then_calls_save(make_order, fulfil) -> None:
    """A post_save receiver puts the order on the save() road: on PostgreSQL its first text
    is ``BEGIN``, the claim with the spent payment and the read; then the model's own
    ``save()`` (its UPDATE), and the follow-up's outbox row with ``COMMIT`` in one text:
    two round trips fewer than the usual road (three with a follow-up), and the receiver
    sees the same as there."""
    config = {
        **settings.IDEMPOTENT_ORDERS,
        "FULFIL_AFTER_PAYMENT": fulfil,
        "OUTBOX_PUBLISH_ON_COMMIT": False,
    }
    seen: list[dict[str, Any]] = []

    def watch(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
        message = current_message()
        inbox = ProcessedMessage.objects.filter(order_id=instance.pk).values_list(
            "status", "outcome"
        )
        seen.append(
            {
                "fields": {
                    f.attname: getattr(instance, f.attname)
                    for f in Order._meta.concrete_fields
                    if f.attname
                    not in ("id", "business_key", "payment_id", "created_at", "updated_at")
                },
                "payment_id": instance.payment_id == f"pay-{instance.pk}",
                "created": created,
                "update_fields": kwargs["update_fields"],
                "deferred": instance.get_deferred_fields(),
                "message": message is not None and message.order_id == instance.pk,
                "in_atomic_block": connection.in_atomic_block,
                "inbox": list(inbox),  # the claim, in the same transaction
            }
        )

    with override_settings(IDEMPOTENT_ORDERS=config):
        # What the first message of a process does once is not counted.
        assert consume_message(payment(make_order()), consumer="payments") is Outcome.APPLIED
        usual, merged = make_order(), make_order()
        post_save.connect(watch, sender=Order, weak=False, dispatch_uid="test-save-road")
        try:
            assert road(Order, "pay")[0] == "save"
            standing_aside = mock.patch.object(writing, "_in_two_texts", _declined)
            with standing_aside, round_trips() as trips:
                assert consume_message(payment(usual), consumer="payments") is Outcome.APPLIED
                usual_trips = trips()
            texts: list[str] = []
            with round_trips(texts) as trips:
                assert consume_message(payment(merged), consumer="payments") is Outcome.APPLIED
                merged_trips = trips()
        finally:
            post_save.disconnect(sender=Order, dispatch_uid="test-save-road")
    # The driver's own BEGIN, the read and save()'s own round trip; with a follow-up, its
    # row's own round trip.
    assert merged_trips == usual_trips - (4 if fulfil else 3)
    # BEGIN, the claim with the spent payment and the read; save()'s UPDATE, held for the
    # text of the receiver's own SELECT; the follow-up's outbox row with COMMIT (or COMMIT
    # alone).
    assert merged_trips == 3
    assert texts[0].startswith('"BEGIN; ')
    assert texts[0].count("EXECUTE idempotent_orders_") == 2  # the claim, the read
    assert texts[1].startswith(f'"WITH moved AS (UPDATE "{Order._meta.db_table}" SET ')
    assert f'SELECT "{ProcessedMessage._meta.db_table}"' in texts[1]
    if fulfil:
        assert f'INSERT INTO "{OutboxMessage._meta.db_table}"' in "".join(texts[2:])
        assert texts[-1].endswith('; COMMIT"'), texts
    else:
        assert texts[-1] == '"COMMIT"'
    assert len(seen) == 2
    assert seen[0] == seen[1]
    assert seen[1]["fields"]["status"] == OrderStatus.PAID
    assert seen[1]["fields"]["version"] == 1
    assert seen[1]["payment_id"]
    assert seen[1]["message"]
    assert seen[1]["in_atomic_block"]
    assert seen[1]["created"] is False
    assert seen[1]["update_fields"] is None
    assert seen[1]["inbox"] == [("done", "applied")]
    for order in (usual, merged):
        order.refresh_from_db()
        assert (order.status, order.version) == (OrderStatus.PAID, 1)
        assert SpentPayment.objects.get(payment_id=f"pay-{order.pk}").order_id == order.pk
        queued = OutboxMessage.objects.filter(message_id=f"fulfil-{order.pk}").count()
        assert queued == (1 if fulfil else 0)


@contextmanager
def _outbox_refused() -> Iterator[None]:
    """A trigger that refuses every outbox row (a constraint of the project's, say)."""
    table = connection.ops.quote_name(OutboxMessage._meta.db_table)
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(
                f"CREATE TRIGGER io_test_refuse BEFORE INSERT ON {table} FOR EACH ROW"
                " SIGNAL SQLSTATE '23000' SET MESSAGE_TEXT = 'outbox refused', MYSQL_ERRNO = 1048"
            )
            undo = ["DROP TRIGGER io_test_refuse"]
        else:
            cursor.execute(
                "CREATE FUNCTION io_test_refuse() RETURNS trigger LANGUAGE plpgsql AS"
                " $$ BEGIN RAISE EXCEPTION 'outbox refused' USING ERRCODE = 'check_violation';"
                " END $$"
            )
            cursor.execute(
                f"CREATE TRIGGER io_test_refuse BEFORE INSERT ON {table}"
                " FOR EACH ROW EXECUTE FUNCTION io_test_refuse()"
            )
            undo = [f"DROP TRIGGER io_test_refuse ON {table}", "DROP FUNCTION io_test_refuse()"]
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            for statement in undo:
                cursor.execute(statement)


@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db(transaction=True)
def test_the_save_road_sends_the_follow_up_with_commit_and_a_refused_row_undoes_all(
    make_order,
) -> None:
    """On the save() road the follow-up's outbox row goes in the text that commits, after
    the model's ``save()`` and its ``post_save`` receivers; ``on_commit`` callbacks run after
    the commit. A row the database refuses stops that text before ``COMMIT``: the order,
    the claim and the spent payment are rolled back with it."""
    config = {**settings.IDEMPOTENT_ORDERS, "FULFIL_AFTER_PAYMENT": True}
    events: list[tuple[str, Any]] = []

    def watch(sender: Any, instance: Any, **kwargs: Any) -> None:
        events.append(("post_save", connection.in_atomic_block))
        transaction.on_commit(lambda: events.append(("on_commit", connection.in_atomic_block)))

    published: list[int] = []
    with override_settings(IDEMPOTENT_ORDERS=config):
        assert consume_message(payment(make_order()), consumer="payments") is Outcome.APPLIED
        applied, refused = make_order(), make_order()
        post_save.connect(watch, sender=Order, weak=False, dispatch_uid="test-save-road-row")
        publish = mock.patch.object(
            producer, "_publish_after_commit", lambda pk, db, keyed=False: published.append(pk)
        )
        try:
            texts: list[str] = []
            with publish, round_trips(texts) as trips:
                assert consume_message(payment(applied), consumer="payments") is Outcome.APPLIED
                trips()
            failed_texts: list[str] = []
            with _outbox_refused(), round_trips(failed_texts) as trips:
                with pytest.raises(MessageFailed):
                    consume_message(payment(refused), consumer="payments")
                trips()
        finally:
            post_save.disconnect(sender=Order, dispatch_uid="test-save-road-row")
    for sent, order in ((texts, applied), (failed_texts, refused)):
        queued = [t for t in sent if f"fulfil-{order.pk}" in t]  # the outbox row's id
        assert len(queued) == 1, sent
        assert queued[0].rstrip('"').endswith("; COMMIT"), sent
    row = OutboxMessage.objects.get(message_id=f"fulfil-{applied.pk}")
    assert published == [row.pk]
    # The receiver in the transaction, its on_commit callback after it (twice: the refused
    # message's receiver ran too, and its callback never did).
    assert events == [("post_save", True), ("on_commit", False), ("post_save", True)]
    applied.refresh_from_db()
    refused.refresh_from_db()
    assert (applied.status, applied.version) == (OrderStatus.PAID, 1)
    assert (refused.status, refused.version) == (OrderStatus.PENDING_PAYMENT, 0)
    assert not OutboxMessage.objects.filter(message_id=f"fulfil-{refused.pk}").exists()
    assert not SpentPayment.objects.filter(order_id=refused.pk).exists()
    inbox = ProcessedMessage.objects.get(consumer="payments", order_id=refused.pk)
    assert inbox.outcome != Outcome.APPLIED
    assert "outbox refused" in inbox.error


def _own_validator(order: Any, payload: Any) -> dict[str, Any]:
    """A project's own validator: no road without a read may take its messages."""
    return {}


@pytest.fixture
def cancel_with_own_validator() -> Iterator[str]:
    saved = dict(registry._registry)
    registry.register("test.cancel", transition="cancel", validate=_own_validator)
    yield "test.cancel"
    registry._registry.clear()
    registry._registry.update(saved)


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_what_one_statement_cannot_take_is_claimed_and_read_in_one_text(
    make_order, cancel_with_own_validator
) -> None:
    """Nothing of the project's runs, yet no statement decides it without a read: a
    transition with two sources (``ship``), a project's own validator. Two texts: ``BEGIN``,
    the claim and the read; the UPDATE and ``COMMIT``, where the usual road takes five."""
    assert consume_message(payment(make_order()), consumer="payments") is Outcome.APPLIED
    paid, processing, fresh, usual = (make_order() for _ in range(4))
    Order.objects.filter(pk__in=[paid.pk, usual.pk]).update(status=OrderStatus.PAID)
    Order.objects.filter(pk=processing.pk).update(status=OrderStatus.PROCESSING)
    cancel = {
        "message_id": f"cancel-{fresh.pk}",
        "type": cancel_with_own_validator,
        "order_id": fresh.pk,
        "payload": {},
    }
    counted = []
    with transitions_heard() as heard:
        for message, consumer in (
            (shipment(paid), "shipping"),
            (shipment(processing), "shipping"),
            (cancel, "payments"),
        ):
            texts: list[str] = []
            with round_trips(texts) as trips:
                assert consume_message(message, consumer=consumer) is Outcome.APPLIED
                counted.append(trips())
            assert texts[0].startswith('"BEGIN; '), texts
            assert texts[-1].endswith('; COMMIT"'), texts
        with mock.patch.object(writing, "_in_two_texts", _declined), round_trips() as trips:
            message = shipment(usual)
            assert consume_message(message, consumer="shipping") is Outcome.APPLIED
            usual_trips = trips()
    assert counted == [2, 2, 2]
    assert usual_trips == 5  # BEGIN, the claim, the read, the UPDATE, COMMIT
    # What the project's listeners hear: the source each order was in.
    assert heard == [
        (paid.pk, OrderStatus.SHIPPED, 1, OrderStatus.PAID),
        (processing.pk, OrderStatus.SHIPPED, 1, OrderStatus.PROCESSING),
        (fresh.pk, OrderStatus.CANCELLED, 1, OrderStatus.PENDING_PAYMENT),
        (usual.pk, OrderStatus.SHIPPED, 1, OrderStatus.PAID),
    ]
    for order, status in (
        (paid, OrderStatus.SHIPPED),
        (processing, OrderStatus.SHIPPED),
        (fresh, OrderStatus.CANCELLED),
    ):
        order.refresh_from_db()
        assert (order.status, order.version, order.tracking_number) == (
            status,
            1,
            f"TRK{order.pk}" if status == OrderStatus.SHIPPED else order.tracking_number,
        )
        assert ProcessedMessage.objects.get(order_id=order.pk).outcome == Outcome.APPLIED


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_a_message_one_statement_declined_is_not_claimed_again_before_the_read(
    make_order,
) -> None:
    """A payment one_statement could take, declined by the order (paid already):
    the two texts send nothing, the road reads and says why."""
    assert consume_message(payment(make_order()), consumer="payments") is Outcome.APPLIED
    orders = [make_order() for _ in range(3)]
    Order.objects.filter(pk__in=[o.pk for o in orders]).update(status=OrderStatus.PAID)
    # What the first declined message of a process does once is not counted.
    assert consume_message(payment(orders.pop()), consumer="payments") is not Outcome.APPLIED
    claimed: list[Any] = []
    real = writing._claim_and_read

    def spy(*args: Any, **kwargs: Any) -> Any:
        claimed.append(args[0].message_id)
        return real(*args, **kwargs)

    sent = []
    for order, road_ in ((orders[0], writing._in_two_texts), (orders[1], _declined)):
        with (
            mock.patch.object(writing, "_in_two_texts", road_),
            mock.patch.object(writing, "_claim_and_read", spy),
            round_trips() as trips,
        ):
            assert consume_message(payment(order), consumer="payments") is not Outcome.APPLIED
            sent.append(trips())
    assert claimed == []
    assert sent[0] == sent[1]
    for order in orders:
        order.refresh_from_db()
        assert (order.status, order.version) == (OrderStatus.PAID, 0)


@pytest.mark.backends("mysql")
@pytest.mark.django_db(transaction=True)
def test_mariadb_claims_and_reads_what_at_once_cannot_take_in_one_text(
    make_order, cancel_with_own_validator
) -> None:
    """A project's own validator (``cancel``) and a transition with a receiver (``ship``):
    on MariaDB two texts, ``START TRANSACTION`` with the read and the claim, then the
    UPDATE and ``COMMIT``, where the road one statement at a time sends autocommit off,
    the read, the claim, the UPDATE, ``COMMIT`` and autocommit on."""
    assert consume_message(payment(make_order()), consumer="payments") is Outcome.APPLIED
    fresh, paid, usual = make_order(), make_order(), make_order()
    Order.objects.filter(pk=paid.pk).update(status=OrderStatus.PAID)

    def cancel(order: Order) -> dict[str, Any]:
        return {
            "message_id": f"cancel-{order.pk}",
            "type": cancel_with_own_validator,
            "order_id": order.pk,
            "payload": {},
        }

    counted = []
    pre_transition.connect(_receiver, sender=Order)
    try:
        with transitions_heard() as heard:
            for message, consumer in ((cancel(fresh), "payments"), (shipment(paid), "shipping")):
                texts: list[str] = []
                with round_trips(texts) as trips:
                    assert consume_message(message, consumer=consumer) is Outcome.APPLIED
                    counted.append(trips())
                assert texts[0].startswith("START TRANSACTION; SELECT "), texts
                assert texts[-1].endswith("; COMMIT"), texts
            standing_aside = mock.patch.object(writing, "_in_two_texts", _declined)
            with standing_aside, round_trips() as trips:
                assert consume_message(cancel(usual), consumer="payments") is Outcome.APPLIED
                usual_trips = trips()
    finally:
        pre_transition.disconnect(_receiver, sender=Order)
    assert counted == [2, 2]
    assert usual_trips == 6
    assert heard == [
        (fresh.pk, OrderStatus.CANCELLED, 1, OrderStatus.PENDING_PAYMENT),
        (paid.pk, OrderStatus.SHIPPED, 1, OrderStatus.PAID),
        (usual.pk, OrderStatus.CANCELLED, 1, OrderStatus.PENDING_PAYMENT),
    ]
    for order, status in (
        (fresh, OrderStatus.CANCELLED),
        (paid, OrderStatus.SHIPPED),
        (usual, OrderStatus.CANCELLED),
    ):
        order.refresh_from_db()
        assert (order.status, order.version) == (status, 1)
        assert ProcessedMessage.objects.get(order_id=order.pk).outcome == Outcome.APPLIED
    assert connection.get_autocommit()
    assert connection.connection.get_autocommit()


@pytest.mark.backends("mysql")
@pytest.mark.django_db(transaction=True)
def test_what_mariadb_two_texts_decline_leaves_nothing_written(
    make_order, cancel_with_own_validator
) -> None:
    """A duplicate, an order in another state, a message out of sequence, an order with
    parked messages: the first text's claim is rolled back (nothing of it written when
    _in_two_texts returns), and the road reads, decides and says why."""
    assert consume_message(payment(make_order()), consumer="payments") is Outcome.APPLIED
    done, paid, early, waiting = (make_order() for _ in range(4))
    Order.objects.filter(pk=paid.pk).update(status=OrderStatus.PAID)

    def cancel(order: Order, suffix: str = "", seq: int | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {
            "message_id": f"cancel-{order.pk}{suffix}",
            "type": cancel_with_own_validator,
            "order_id": order.pk,
            "payload": {},
        }
        if seq is not None:
            message["seq"] = seq
        return message

    first = cancel(done)
    assert consume_message(first, consumer="payments") is Outcome.APPLIED
    # A message parked on ``waiting``: its order has parked messages.
    assert consume_message(shipment(waiting, seq=3), consumer="shipping") is Outcome.PARKED
    declined = [
        (first, Outcome.DUPLICATE),
        (cancel(paid), Outcome.REJECTED),
        (cancel(early, seq=2), Outcome.PARKED),
        (cancel(waiting), Outcome.APPLIED),  # then it releases what waits
    ]
    before = {
        o.pk: (o.status, o.version, o.has_parked)
        for o in Order.objects.filter(pk__in=[done.pk, paid.pk, early.pk, waiting.pk])
    }
    inbox = ProcessedMessage.objects.count()
    for message, _ in declined:
        texts: list[str] = []
        with round_trips(texts) as trips:
            # The road itself (the usual road's dedup fast path would answer a duplicate).
            envelope = parse_envelope(message, consumer="payments")
            assert writing._in_two_texts(envelope, "payments", Order) is None
            trips()
        # The first text went, and was rolled back: nothing of it is left.
        assert texts[0].startswith("START TRANSACTION; SELECT "), texts
        assert texts[-1] == "ROLLBACK", texts
        assert ProcessedMessage.objects.count() == inbox
        after = {
            o.pk: (o.status, o.version, o.has_parked)
            for o in Order.objects.filter(pk__in=list(before))
        }
        assert after == before
        assert not SpentPayment.objects.filter(order_id__in=list(before)).exists()
        assert connection.get_autocommit()
        assert connection.connection.get_autocommit()
    # The usual road decides each and says why.
    for message, expected in declined:
        assert consume_message(message, consumer="payments") is expected
    assert connection.get_autocommit()
    assert connection.connection.get_autocommit()
