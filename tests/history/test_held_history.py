"""The history packages on the save() road, in round trips: ``save()``'s UPDATE held for the
text of the first statement their receivers send."""

from __future__ import annotations

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
