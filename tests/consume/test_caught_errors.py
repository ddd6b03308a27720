"""A database error the project's code catches inside the message's transaction.

PostgreSQL aborts the whole transaction at any error and answers its ``COMMIT`` with a
rollback that the driver does not raise: a message whose receiver swallowed such an
error must not be reported applied (and its redelivery taken for a duplicate) with
nothing written. It is kept as failed, with the reason. MariaDB and SQLite undo only the
failed statement, and the message applies."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.conf import settings
from django.db import DatabaseError, connection
from django.db.models.signals import post_save
from django.test.utils import override_settings

from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.failures import MessageFailed
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import InboxStatus, Order, OrderStatus, Outcome, ProcessedMessage
from tests.support.messages import payment

pytestmark = pytest.mark.django_db(transaction=True)


@contextmanager
def _swallowing() -> Iterator[list[str]]:
    """A ``post_save`` receiver on Order whose own statement fails and that catches the
    error; the fulfilment follow-up off, so nothing of the app's is sent after it."""
    caught: list[str] = []

    def receiver(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
        if created:
            return
        try:
            with connection.cursor() as cursor:
                cursor.execute("INSERT INTO io_no_such_table VALUES (1)")
        except DatabaseError as exc:
            caught.append(type(exc).__name__)

    config = {**settings.IDEMPOTENT_ORDERS, "FULFIL_AFTER_PAYMENT": False}
    post_save.connect(receiver, sender=Order, weak=False, dispatch_uid="test-caught-errors")
    try:
        with override_settings(IDEMPOTENT_ORDERS=config):
            yield caught
    finally:
        post_save.disconnect(sender=Order, dispatch_uid="test-caught-errors")


def _ends_as_the_database_allows(order: Order, message: dict[str, Any], outcome: Any) -> None:
    row = Order.objects.get(pk=order.pk)
    inbox = ProcessedMessage.objects.get(message_id=message["message_id"])
    if connection.vendor == "postgresql":
        assert outcome is Outcome.FAILED
        assert (row.status, row.version) == (OrderStatus.PENDING_PAYMENT, 0)
        assert inbox.status == InboxStatus.FAILED
        assert "TransactionAborted" in inbox.error, inbox.error
    else:
        assert outcome is Outcome.APPLIED
        assert (row.status, row.version) == (OrderStatus.PAID, 1)
        assert inbox.outcome == Outcome.APPLIED


def test_a_message_whose_receiver_caught_a_database_error(make_order) -> None:
    order = make_order()
    message = payment(order)
    with _swallowing() as caught:
        try:
            outcome = consume_message(message, consumer="payments")
        except MessageFailed:
            outcome = Outcome.FAILED
    assert caught
    _ends_as_the_database_allows(order, message, outcome)


def test_a_batch_whose_receiver_caught_a_database_error(make_order) -> None:
    orders = [make_order() for _ in range(2)]
    messages = [payment(o) for o in orders]
    with _swallowing() as caught:
        outcomes = consume_batch(messages, consumer="payments")
    assert caught
    for order, message, outcome in zip(orders, messages, outcomes, strict=True):
        _ends_as_the_database_allows(order, message, outcome)
