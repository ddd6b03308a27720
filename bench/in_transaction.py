"""Messages consumed inside a caller's transaction, timed: ``python -m bench.in_transaction``.

``BENCH_IN_TRANSACTION_MESSAGES`` (600) new payments of the app's ``Order`` with a
``pre_transition`` receiver (so no road without a read takes them), three ways, round
by round (three rounds), each round's rate printed:

- ``in a caller's transaction``: each ``consume_message`` inside the project's own
  ``transaction.atomic()`` block (the road's two texts in a savepoint, where the
  database sends several statements a text);
- ``the same, one statement at a time``: the same, the two texts and the roads without a
  read standing aside (every statement a round trip of its own: the road of SQLite, and
  what the texts decline);
- ``alone``: each ``consume_message`` outside any transaction (its own).

``--plain``: the app's ``Order`` as it is (nothing of the project's runs: on PostgreSQL
the road's one statement, in a caller's transaction in one text with its savepoint).

The database is ``IO_TEST_DATABASE`` (``postgres``, the default here, ``mariadb`` or
``sqlite``); on MariaDB the database ``BENCH_DB_NAME`` must exist.

``--race``: four threads at once, each with a payment of its own for every one of 200
orders, in the same order (one applies, the others are money to give back): how long
it took, and how many transactions the database rolled back to break a deadlock (each
run again by the road).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from bench.common import make_orders, payment, setup

N = int(os.environ.get("BENCH_IN_TRANSACTION_MESSAGES", "600"))
ROUNDS = 3


def race() -> None:
    """``--race``: see the module's docstring."""
    from django.db import connection, connections, transaction

    from idempotent_orders.consuming import failures, single
    from idempotent_orders.models import Outcome

    threads, count = 4, 200
    orders = make_orders(count)
    rolled_back = []
    real = failures.is_retryable

    def counted(exc: Exception) -> bool:
        retry = real(exc)
        if retry:
            rolled_back.append(1)
        return retry

    single.is_retryable = counted  # type: ignore[attr-defined]
    outcomes: list[Outcome] = []

    def consume(n: int) -> None:
        try:
            for order in orders:
                message = payment(order, f"race-{n}-")
                message["payload"]["payment_id"] = f"race-{n}-{order.pk}"
                with transaction.atomic():
                    outcomes.append(single.consume_message(message, consumer="payments"))
        finally:
            connections.close_all()

    pool = [threading.Thread(target=consume, args=(n,)) for n in range(threads)]
    start = time.perf_counter()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    took = time.perf_counter() - start
    applied = outcomes.count(Outcome.APPLIED)
    print(
        f"{connection.vendor}: {threads} threads x {count} orders in a caller's transaction:"
        f" {took:.2f} s, {applied} applied of {len(outcomes)},"
        f" {len(rolled_back)} transactions rolled back to break a deadlock"
    )


def main() -> None:
    setup()
    if "--race" in sys.argv:
        race()
        return
    from django.db import connection, transaction
    from django_fsm.signals import pre_transition

    from idempotent_orders.consuming import consume_message
    from idempotent_orders.models import Order, Outcome

    def heard(sender: object, **kwargs: object) -> None:
        """A receiver: the project's code runs with the transition."""

    if "--plain" not in sys.argv:
        pre_transition.connect(heard, sender=Order, weak=False)
    from contextlib import ExitStack, nullcontext
    from unittest import mock

    from idempotent_orders.consuming import writing
    from idempotent_orders.consuming.backends import Backend

    def one_at_a_time() -> Any:
        """The two texts and the roads without a read standing aside."""
        stack = ExitStack()
        stack.enter_context(mock.patch.object(writing, "_in_two_texts", return_value=None))
        stack.enter_context(mock.patch.object(Backend, "roads_without_read", return_value=[]))
        return stack

    ways = {
        "in a caller's transaction": (transaction.atomic, nullcontext),
        "the same, one statement at a time": (transaction.atomic, one_at_a_time),
        "alone": (nullcontext, nullcontext),
    }
    rates: dict[str, list[float]] = {way: [] for way in ways}
    for round_ in range(ROUNDS):
        for way, (around, road) in ways.items():
            orders = make_orders(N)
            tag = f"in-tx-{round_}-{time.time_ns()}-"
            with road():
                start = time.perf_counter()
                for order in orders:
                    with around():
                        outcome = consume_message(payment(order, tag), consumer="payments")
                    assert outcome is Outcome.APPLIED, outcome
                rates[way].append(N / (time.perf_counter() - start))
    kind = "Order as it is" if "--plain" in sys.argv else "Order with a pre_transition receiver"
    print(
        f"{connection.vendor}: consume_message, {N} new payments of {kind} a round, {ROUNDS} rounds"
    )
    for way, got in rates.items():
        print(f"  {way}: " + " / ".join(f"{rate:,.0f}/s" for rate in got))


if __name__ == "__main__":
    main()
