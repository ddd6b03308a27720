"""Section 4 (part): a naive check-then-insert consumer against consume_message, under concurrency."""

from __future__ import annotations

import os
import threading
from typing import Any

from bench.common import Row, make_orders, payment, setup

THREADS = int(os.environ.get("BENCH_NAIVE_THREADS", "8"))
MESSAGES = int(os.environ.get("BENCH_NAIVE_MESSAGES", "100"))


def _naive(message: dict[str, Any]) -> None:
    """Check the inbox, then do the work, then record: the race the inbox index closes."""
    from django.db import connection, transaction

    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(
            "SELECT 1 FROM bench_naive_inbox WHERE message_id = %s", [message["message_id"]]
        )
        if cur.fetchone():
            return
        cur.execute(
            "UPDATE bench_naive_effects SET n = n + 1 WHERE order_id = %s", [message["order_id"]]
        )
        cur.execute(
            "INSERT INTO bench_naive_inbox (message_id) VALUES (%s)", [message["message_id"]]
        )


def _storm(fn: Any, messages: list[dict[str, Any]]) -> None:
    barrier = threading.Barrier(THREADS)

    def worker() -> None:
        from django.db import connection

        barrier.wait()
        try:
            for m in messages:  # every thread delivers every message: THREADS copies each
                fn(m)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run() -> list[Row]:
    setup()
    from django.db import connection

    from idempotent_orders.consuming.single import consume_message
    from idempotent_orders.models import Order

    with connection.cursor() as cur:
        cur.execute("DROP TABLE IF EXISTS bench_naive_inbox, bench_naive_effects")
        cur.execute("CREATE TABLE bench_naive_inbox (message_id text)")  # no unique index
        cur.execute("CREATE TABLE bench_naive_effects (order_id bigint primary key, n int)")
    orders = make_orders(MESSAGES)
    with connection.cursor() as cur:
        cur.executemany("INSERT INTO bench_naive_effects VALUES (%s, 0)", [(o.pk,) for o in orders])
    messages = [payment(o, "naive-") for o in orders]
    _storm(_naive, messages)
    with connection.cursor() as cur:
        cur.execute("SELECT coalesce(sum(n), 0) - count(*) FROM bench_naive_effects")
        naive_dups = cur.fetchone()[0]

    orders = make_orders(MESSAGES)
    messages = [payment(o, "ours-") for o in orders]
    _storm(lambda m: consume_message(m, consumer="payments"), messages)
    ours = sum(
        Order.objects.filter(pk__in=[o.pk for o in orders]).values_list("version", flat=True)
    )
    ours_dups = ours - MESSAGES
    what = f"{MESSAGES} msgs x {THREADS} threads"
    return [
        Row(
            "4 peers: naive consumer",
            f"check-then-insert, {what}",
            f"{naive_dups} dup",
            "effects applied twice or more",
        ),
        Row(
            "4 peers: naive consumer",
            f"consume_message, {what}",
            f"{ours_dups} dup",
            "inbox unique index + conditional UPDATE",
        ),
    ]


if __name__ == "__main__":
    from bench.common import print_table

    print_table(run())
