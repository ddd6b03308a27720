"""Parked messages are never lost: concurrent fillers, fillers redelivered after a crash."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection

from idempotent_orders import dedup
from idempotent_orders.consuming import single
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import OrderStatus, Outcome, ParkedMessage
from tests.support.messages import payment, shipment
from tests.support.services import RedisServer, private_redis_settings


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_successor_parked_while_its_predecessor_commits_is_released(make_order) -> None:
    """Two threads deliver seq 1 and seq 2 of an order at the same instant, many times."""
    orders = [make_order() for _ in range(40)]
    errors: list[BaseException] = []
    for order in orders:
        barrier = threading.Barrier(2)

        def run(
            message: dict[str, Any], consumer: str, barrier: threading.Barrier = barrier
        ) -> None:
            try:
                barrier.wait(5)
                consume_message(message, consumer=consumer)
            except BaseException as exc:
                errors.append(exc)
            finally:
                connection.close()

        threads = [
            threading.Thread(target=run, args=(shipment(order, seq=2), "shipping")),
            threading.Thread(target=run, args=(payment(order, seq=1), "payments")),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors
    assert not ParkedMessage.objects.exists()
    for order in orders:
        order.refresh_from_db()
        assert (order.status, order.last_seq, order.version) == (OrderStatus.SHIPPED, 2, 2)


@pytest.mark.django_db(transaction=True)
def test_filler_redelivered_after_a_crash_still_releases(make_order, monkeypatch) -> None:
    """The worker applying the filler dies after commit, before releasing successors.

    Its redelivery must reach the database (nothing was remembered in the fast
    path yet) and release the parked message there, with Redis up.
    """
    server = RedisServer()
    server.start()
    try:
        with private_redis_settings(server.url):
            order = make_order()
            waiting = shipment(order, seq=2)
            assert consume_message(waiting, consumer="shipping") is Outcome.PARKED
            filler = payment(order, seq=1)

            def crash(order_id: int) -> list[Outcome]:
                raise SystemExit("worker killed")

            monkeypatch.setattr(single, "release_parked", crash)
            with pytest.raises(SystemExit):
                consume_message(filler, consumer="payments")
            monkeypatch.undo()
            assert ParkedMessage.objects.count() == 1
            assert not server.keys("*processed:payments:*")

            assert consume_message(filler, consumer="payments") is Outcome.DUPLICATE
            assert not ParkedMessage.objects.exists()
            order.refresh_from_db()
            assert (order.status, order.last_seq) == (OrderStatus.SHIPPED, 2)
            assert dedup.flush()
            assert server.keys("*processed:payments:*")
    finally:
        server.stop()


@pytest.mark.django_db
def test_filler_that_changes_nothing_still_fills_the_gap(make_order) -> None:
    order = make_order()
    assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    assert consume_message(shipment(order, seq=2), consumer="shipping") is Outcome.PARKED
    # seq 1 is a second payment notice: a duplicate by state, but it is seq 1.
    assert consume_message(payment(order, seq=1), consumer="payments") is Outcome.DUPLICATE
    order.refresh_from_db()
    assert (order.status, order.last_seq) == (OrderStatus.SHIPPED, 2)
    assert not ParkedMessage.objects.exists()
