"""A batch chunk's ``save()`` UPDATEs held for the next text (PostgreSQL, MariaDB): on the
batch's save() road each transition is the model's own ``save()`` in the message's
savepoint; its guarded UPDATE waits for the next statement on the connection. A chunk
whose receivers send nothing sends all its saves with its first write; a receiver's
statement carries the earlier messages' UPDATEs ahead of its message's ``SAVEPOINT`` and
its own after it, so a message whose code raises rolls back its own and no other's; an
order the project's code moved under the chunk's lock sends the chunk one by one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.db import connection
from django.db.models import F
from django.db.models.signals import post_save, pre_save
from django.test.utils import override_settings

from idempotent_orders.consuming import batch as batch_module
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.running import road
from idempotent_orders.models import Order, OrderStatus, Outcome, ProcessedMessage
from tests.support.messages import payment
from tests.support.round_trips import round_trips

pytestmark = [
    pytest.mark.backends("postgresql", "mysql"),
    pytest.mark.django_db(transaction=True),
]


@contextmanager
def _receiver(signal: Any, receiver: Callable[..., Any]) -> Iterator[None]:
    """``receiver`` on Order's ``signal``: the model takes the save() road."""
    signal.connect(receiver, sender=Order, weak=False, dispatch_uid="test-held-saves")
    try:
        assert road(Order, "pay")[0] == "save"
        config = {**settings.IDEMPOTENT_ORDERS, "OUTBOX_PUBLISH_ON_COMMIT": False}
        with override_settings(IDEMPOTENT_ORDERS=config):
            yield
    finally:
        signal.disconnect(sender=Order, dispatch_uid="test-held-saves")


def _quiet(sender: Any, **kwargs: Any) -> None:
    """A receiver that sends nothing."""


def _row(order: Order) -> tuple[str, int, str]:
    row = Order.objects.get(pk=order.pk)
    return row.status, row.version, row.payment_id


def test_a_chunks_saves_go_together_in_one_text(make_order) -> None:
    """Receivers that send nothing: no message's code sends a statement, so no savepoint is
    taken and every save()'s UPDATE goes in one text before the chunk commits. A chunk of
    five takes the round trips of a chunk of one."""
    table = connection.ops.quote_name(Order._meta.db_table)
    trips: list[int] = []
    texts: list[str] = []
    with _receiver(post_save, _quiet):  # what a first chunk of the process looks up once
        assert consume_batch([payment(make_order())], consumer="payments") == [Outcome.APPLIED]
    for size in (1, 5):
        orders = [make_order() for _ in range(size)]
        texts.clear()
        with _receiver(post_save, _quiet), round_trips(texts) as count:
            outcomes = consume_batch([payment(o) for o in orders], consumer="payments")
            trips.append(count())
        assert outcomes == [Outcome.APPLIED] * size
        assert [_row(o) for o in orders] == [(OrderStatus.PAID, 1, f"pay-{o.pk}") for o in orders]
    carrying = [t for t in texts if f"UPDATE {table} SET " in t]
    assert len(carrying) == 1, "\n".join(t[:150] for t in texts)
    assert carrying[0].count(f"UPDATE {table} SET ") == 5
    assert "SAVEPOINT" not in " ".join(texts)
    assert trips[1] == trips[0], trips


def test_a_receivers_statement_carries_the_earlier_saves_and_a_failure_rolls_back_its_own(
    make_order,
) -> None:
    """Each message's receiver reads its order back: it sees the row as its save() wrote it
    (its UPDATE goes after its SAVEPOINT, in the same text). The third message's receiver
    raises after its read: its UPDATE is rolled back with its savepoint, and the earlier
    messages' UPDATEs, sent before that SAVEPOINT, are kept."""
    orders = [make_order() for _ in range(4)]
    seen: list[tuple[int, str, int]] = []

    def read_back(sender: Any, instance: Order, **kwargs: Any) -> None:
        status, version = Order.objects.values_list("status", "version").get(pk=instance.pk)
        seen.append((instance.pk, status, version))
        if instance.pk == orders[2].pk:
            raise RuntimeError("the receiver refuses this one")

    with _receiver(post_save, read_back):
        outcomes = consume_batch([payment(o) for o in orders], consumer="payments")
    assert outcomes == [Outcome.APPLIED, Outcome.APPLIED, Outcome.FAILED, Outcome.APPLIED]
    assert seen == [(o.pk, OrderStatus.PAID, 1) for o in orders]
    assert [_row(o)[:2] for o in orders] == [
        (OrderStatus.PAID, 1),
        (OrderStatus.PAID, 1),
        (OrderStatus.PENDING_PAYMENT, 0),
        (OrderStatus.PAID, 1),
    ]
    failed = ProcessedMessage.objects.get(order_id=orders[2].pk)
    assert "the receiver refuses this one" in failed.error


def test_an_order_the_projects_code_moved_under_the_chunk_sends_it_one_by_one(
    make_order,
) -> None:
    """The project's own ``pre_save`` receiver moves the second order on (a new version) in
    the chunk's transaction, once: that save()'s held UPDATE matches no row, so the chunk
    rolls back whole, with that write, and its messages go one by one; each is applied
    once."""
    orders = [make_order() for _ in range(3)]
    moves: list[int] = []

    def move_on(sender: Any, instance: Order, **kwargs: Any) -> None:
        if instance.pk == orders[1].pk and not moves:
            moves.append(Order.objects.filter(pk=instance.pk).update(version=F("version") + 1))

    alone = mock.Mock(wraps=batch_module._one_by_one)
    with _receiver(pre_save, move_on), mock.patch.object(batch_module, "_one_by_one", alone):
        outcomes = consume_batch([payment(o) for o in orders], consumer="payments")
    assert moves == [1]
    assert alone.call_count == 1
    assert outcomes == [Outcome.APPLIED] * 3
    # The move rolled back with the chunk: each order holds its one transition.
    assert [_row(o) for o in orders] == [(OrderStatus.PAID, 1, f"pay-{o.pk}") for o in orders]
    assert ProcessedMessage.objects.filter(outcome=Outcome.APPLIED).count() == 3


def test_a_held_update_the_database_refuses_fails_its_message_alone(make_order) -> None:
    """The second message's held UPDATE is refused (a value too long for its column) in
    the text of its receiver's read, and the receiver swallows the error: that message is
    kept as failed with the database's error and its order is not written; the others
    apply once."""
    from django.db import DatabaseError

    orders = [make_order() for _ in range(3)]
    swallowed: list[str] = []

    def too_long(sender: Any, instance: Order, **kwargs: Any) -> None:
        if instance.pk == orders[1].pk:
            instance.business_key = "k" * 500

    def swallowing(sender: Any, instance: Order, **kwargs: Any) -> None:
        try:
            Order.objects.filter(pk=instance.pk).exists()
        except DatabaseError as exc:
            swallowed.append(type(exc).__name__)

    pre_save.connect(too_long, sender=Order, weak=False, dispatch_uid="test-held-saves-long")
    try:
        with _receiver(post_save, swallowing):
            outcomes = consume_batch([payment(o) for o in orders], consumer="payments")
    finally:
        pre_save.disconnect(sender=Order, dispatch_uid="test-held-saves-long")
    assert swallowed
    assert outcomes == [Outcome.APPLIED, Outcome.FAILED, Outcome.APPLIED]
    assert [_row(o)[:2] for o in orders] == [
        (OrderStatus.PAID, 1),
        (OrderStatus.PENDING_PAYMENT, 0),
        (OrderStatus.PAID, 1),
    ]
    failed = ProcessedMessage.objects.get(order_id=orders[1].pk)
    # PostgreSQL aborted the transaction at the refusal, which the receiver caught;
    # MariaDB answered the UPDATE alone with the error, which is kept.
    reason = "TransactionAborted" if connection.vendor == "postgresql" else "DataError"
    assert reason in failed.error, failed.error
