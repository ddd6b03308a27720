"""Sections 1 and 5: the consumer in one process against the raw limit, and the batch consumer."""

from __future__ import annotations

import os
from typing import Any

from bench.common import RUNS, Row, fmt, make_orders, median, payment, rate, setup

N = int(os.environ.get("BENCH_CONSUMER_MESSAGES", "400"))
BATCH = int(os.environ.get("BENCH_BATCH_SIZE", "200"))


def _raw(orders: list[Any], tag: str) -> None:
    """psycopg by hand: the inbox INSERT and the conditional UPDATE, one transaction each."""
    from django.db import connection

    from idempotent_orders.models import Order, ProcessedMessage

    inbox, table = ProcessedMessage._meta.db_table, Order._meta.db_table
    raw = connection.connection  # the psycopg connection under Django's
    for order in orders:
        with raw.transaction(), raw.cursor() as cur:
            cur.execute(
                f"INSERT INTO {inbox} (consumer, message_id, message_type, status, outcome,"
                " order_id, attempts, error, body, created_at, updated_at)"
                " VALUES (%s, %s, %s, 'done', 'applied', %s, 1, '', '', now(), now())",
                ("raw", f"pay-{tag}{order.pk}", "payment.succeeded", order.pk),
            )
            cur.execute(
                f"UPDATE {table} SET status = 'paid', version = version + 1, payment_id = %s,"
                " updated_at = now() WHERE id = %s AND status IN ('pending_payment')"
                " AND version = %s",
                (f"p{order.pk}", order.pk, order.version),
            )


def one_by_one(messages: list[dict[str, Any]]) -> None:
    """Each message through ``consume_message``, as a per-message consumer would."""
    from idempotent_orders.consuming.single import consume_message

    for message in messages:
        consume_message(message, consumer="payments")


def in_batches(messages: list[dict[str, Any]]) -> None:
    """The messages through ``consume_batch``, ``BATCH`` at a time."""
    from idempotent_orders.consuming.batch import consume_batch

    for i in range(0, len(messages), BATCH):
        consume_batch(messages[i : i + BATCH], consumer="payments")


def run() -> list[Row]:
    setup()
    from django.db import connection

    from idempotent_orders import dedup

    connection.ensure_connection()
    raw_rates, new_rates, dup_rates, batch_rates = [], [], [], []
    for run_no in range(RUNS):
        orders = make_orders(N)
        raw_rates.append(rate(N, lambda o=orders, t=f"r{run_no}-": _raw(o, t)))
        orders = make_orders(N)
        messages = [payment(o, f"s{run_no}-") for o in orders]
        new_rates.append(rate(N, lambda m=messages: one_by_one(m)))
        dup_rates.append(rate(N, lambda m=messages: one_by_one(m)))
        orders = make_orders(N)
        messages = [payment(o, f"b{run_no}-") for o in orders]
        batch_rates.append(rate(N, lambda m=messages: in_batches(m)))
    raw, new, dup, batch = map(median, (raw_rates, new_rates, dup_rates, batch_rates))
    fast = (
        "fast path wired"
        if _fast_path_active(dedup)
        else "fast path not wired: every duplicate queries the DB"
    )
    return [
        Row("1 consumer (PG, 1 proc)", "raw psycopg INSERT+UPDATE txn", fmt(raw), "the limit"),
        Row(
            "1 consumer (PG, 1 proc)",
            "consume_message, new",
            fmt(new),
            f"{new / raw:.0%} of raw (target >= 100%)",
            figure=new,
            baseline=raw,
            baseline_what="raw psycopg txn",
        ),
        Row(
            "1 consumer (PG, 1 proc)",
            "consume_message, duplicates",
            fmt(dup),
            f"{dup / new:.1f}x new (target >= 10x with the fast path; {fast})",
            figure=dup,
            baseline=new,
            baseline_what="consume_message, new",
        ),
        Row(
            "5 batch (PG, 1 proc)",
            f"consume_batch, new, {BATCH}/batch",
            fmt(batch),
            f"{batch / raw:.1f}x raw (target >= 5x); {batch / new:.1f}x consume_message",
            figure=batch,
            baseline=raw,
            baseline_what="raw psycopg txn",
        ),
    ]


def _fast_path_active(dedup: Any) -> bool:
    # The no-op placeholder module has only seen() and remember().
    return any(
        not name.startswith("_") and name not in {"seen", "remember", "annotations"}
        for name in vars(dedup)
    )


if __name__ == "__main__":
    from bench.common import print_table

    print_table(run())
