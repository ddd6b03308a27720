"""The history packages on the save() road, in round trips: ``save()``'s UPDATE held for the
text of the first statement their receivers send."""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest
from django.db import connection

from idempotent_orders.consuming import writing
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import Outcome
from tests.history.models import Order
from tests.support.messages import payment
from tests.support.round_trips import round_trips

pytestmark = [
    pytest.mark.backends("postgresql", "mysql"),
    pytest.mark.django_db(transaction=True),
]


def test_the_update_goes_in_the_text_of_the_first_statement_after_it(make_order) -> None:
    assert consume_message(payment(make_order()), consumer="payments") is Outcome.APPLIED
    held, at_once = make_order(), make_order()
    texts: list[str] = []
    with round_trips(texts) as trips:
        assert consume_message(payment(held), consumer="payments") is Outcome.APPLIED
        held_trips = trips()
    not_held = mock.patch.object(writing.HeldUpdate, "arm", classmethod(lambda cls, *a: None))
    with not_held, round_trips() as trips:
        assert consume_message(payment(at_once), consumer="payments") is Outcome.APPLIED
        at_once_trips = trips()
    assert held_trips == at_once_trips - 1
    table = connection.ops.quote_name(Order._meta.db_table)
    carried = [t for t in texts if f"UPDATE {table} SET " in t]
    assert len(carried) == 1
    assert "INSERT INTO " in carried[0].split(f"UPDATE {table} SET ", 1)[1]  # the next write
    for order in (held, at_once):
        assert order.history.count() == 2  # created, then paid
        assert Order.objects.get(pk=order.pk).version == 1


def test_a_chunks_updates_go_in_the_texts_of_its_history_rows(make_order) -> None:
    """``consume_batch`` on the same model: each message's first statement (a history row)
    carries the earlier messages' UPDATEs before its ``SAVEPOINT`` and its own after it,
    one round trip a message fewer than each UPDATE with its savepoint; each order's
    history holds its creation and its payment."""
    from idempotent_orders.consuming.batch import consume_batch
    from idempotent_orders.consuming.held import HeldSaves

    assert consume_batch([payment(make_order())], consumer="payments") == [Outcome.APPLIED]
    trips: list[int] = []
    texts: list[str] = []
    for holding in (True, False):
        orders = [make_order() for _ in range(4)]
        unheld = mock.patch.object(HeldSaves, "arm", classmethod(lambda cls, *a: None))
        with nullcontext() if holding else unheld, round_trips(texts) as count:
            outcomes = consume_batch([payment(o) for o in orders], consumer="payments")
            trips.append(count())
        assert outcomes == [Outcome.APPLIED] * 4
        for order in orders:
            assert order.history.count() == 2  # created, then paid
            assert Order.objects.get(pk=order.pk).version == 1
        if holding:
            table = connection.ops.quote_name(Order._meta.db_table)
            carrying = [t for t in texts if f"UPDATE {table} SET " in t]
            assert sum(t.count(f"UPDATE {table} SET ") for t in carrying) == 4
            assert all("INSERT INTO " in t for t in carrying), carrying
    held_trips, at_once_trips = trips
    assert held_trips == at_once_trips - 4, trips
