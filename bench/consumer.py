"""Sections 1 and 5: the consumer in one process against the raw limit, and the batch consumer."""

from __future__ import annotations

import os
from typing import Any

from bench.common import RUNS, Row, fmt, make_orders, median, payment, rate, setup

N = int(os.environ.get("BENCH_CONSUMER_MESSAGES", "400"))
BATCH = int(os.environ.get("BENCH_BATCH_SIZE", "200"))


def _raw(orders: list[Any], tag: str, follow_up: bool) -> None:
    """psycopg by hand, one transaction each, with the writes ``consume_message`` makes: the
    inbox row, the spent payment, the conditional UPDATE and, with the fulfilment
    follow-up on (the default), its outbox row.
    """
    from django.db import connection

    from idempotent_orders.models import Order, OutboxMessage, ProcessedMessage, SpentPayment

    inbox, table = ProcessedMessage._meta.db_table, Order._meta.db_table
    spent, outbox = SpentPayment._meta.db_table, OutboxMessage._meta.db_table
    raw = connection.connection  # the psycopg connection under Django's
    for order in orders:
        with raw.transaction(), raw.cursor() as cur:
            cur.execute(
                f"INSERT INTO {inbox} (consumer, message_id, message_type, status, outcome,"
                " order_id, attempts, error, body, fingerprint, created_at, updated_at)"
                " VALUES (%s, %s, %s, 'done', 'applied', %s, 1, '', '', %s, now(), now())",
                ("raw", f"pay-{tag}{order.pk}", "payment.succeeded", order.pk, "f" * 64),
            )
            cur.execute(
                f"INSERT INTO {spent} (payment_id, order_id, consumer, message_id)"
                " VALUES (%s, %s, 'raw', %s)",
                (f"raw-{tag}{order.pk}", order.pk, f"pay-{tag}{order.pk}"),
            )
            cur.execute(
                f"UPDATE {table} SET status = 'paid', version = version + 1, payment_id = %s,"
                " updated_at = now() WHERE id = %s AND status IN ('pending_payment')"
                " AND version = %s",
                (f"p{order.pk}", order.pk, order.version),
            )
            if follow_up:
                cur.execute(
                    f"INSERT INTO {outbox} (message_id, task_name, payload, options, status,"
                    " attempts, last_error, order_key, traceparent, correlation_id)"
                    " VALUES (%s, 'idempotent_orders.fulfil_order', %s, '{}', 'pending', 0,"
                    " '', %s, '', '')",
                    (f"raw-fulfil-{tag}{order.pk}", str(order.pk), str(order.pk)),
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


def _measure(tag: str, follow_up: bool) -> tuple[float, float, float, float]:
    """Median rates of the raw transaction, new messages, duplicates and batches."""
    raw_rates, new_rates, dup_rates, batch_rates = [], [], [], []
    for run_no in range(RUNS):
        orders = make_orders(N)
        raw_rates.append(rate(N, lambda o=orders, t=f"{tag}r{run_no}-": _raw(o, t, follow_up)))
        orders = make_orders(N)
        messages = [payment(o, f"{tag}s{run_no}-") for o in orders]
        new_rates.append(rate(N, lambda m=messages: one_by_one(m)))
        dup_rates.append(rate(N, lambda m=messages: one_by_one(m)))
        orders = make_orders(N)
        messages = [payment(o, f"{tag}b{run_no}-") for o in orders]
        batch_rates.append(rate(N, lambda m=messages: in_batches(m)))
    return median(raw_rates), median(new_rates), median(dup_rates), median(batch_rates)


def run() -> list[Row]:
    setup()
    from django.conf import settings
    from django.db import connection
    from django.test import override_settings

    from idempotent_orders import dedup

    connection.ensure_connection()
    # The default configuration first (the fulfilment follow-up on, as the app ships);
    # then the tuned road (the follow-up off), a labelled extra row.
    default = {**settings.IDEMPOTENT_ORDERS, "FULFIL_AFTER_PAYMENT": True}
    tuned = {**settings.IDEMPOTENT_ORDERS, "FULFIL_AFTER_PAYMENT": False}
    with override_settings(IDEMPOTENT_ORDERS=default):
        raw, new, dup, batch = _measure("d", follow_up=True)
    with override_settings(IDEMPOTENT_ORDERS=tuned):
        raw_t, new_t, _, batch_t = _measure("t", follow_up=False)
    fast = (
        "fast path wired"
        if _fast_path_active(dedup)
        else "fast path not wired: every duplicate queries the DB"
    )
    same = "inbox + spent payment + UPDATE + follow-up outbox row"
    return [
        Row("1 consumer (PG, 1 proc)", f"raw psycopg txn: {same}", fmt(raw), "the limit"),
        Row(
            "1 consumer (PG, 1 proc)",
            "consume_message, new (default configuration)",
            fmt(new),
            f"{new / raw:.0%} of raw (target >= 100%)",
            figure=new,
            baseline=raw,
            baseline_what="raw psycopg txn, the same writes",
        ),
        Row(
            "1 consumer (PG, 1 proc)",
            "consume_message, duplicates (default configuration)",
            fmt(dup),
            f"{dup / new:.1f}x new (target >= 10x with the fast path; {fast})",
            figure=dup,
            baseline=new,
            baseline_what="consume_message, new",
        ),
        Row(
            "5 batch (PG, 1 proc)",
            f"consume_batch, new, {BATCH}/batch (default configuration)",
            fmt(batch),
            f"{batch / raw:.1f}x raw (target >= 5x); {batch / new:.1f}x consume_message",
            figure=batch,
            baseline=raw,
            baseline_what="raw psycopg txn, the same writes",
        ),
        Row(
            "1 consumer (PG, 1 proc)",
            "tuned (FULFIL_AFTER_PAYMENT off): consume_message, new",
            fmt(new_t),
            f"{new_t / raw_t:.0%} of its raw txn without the outbox row ({fmt(raw_t)})",
            figure=new_t,
            baseline=raw_t,
            baseline_what="raw psycopg txn without the follow-up",
        ),
        Row(
            "5 batch (PG, 1 proc)",
            "tuned (FULFIL_AFTER_PAYMENT off): consume_batch, new",
            fmt(batch_t),
            f"{batch_t / raw_t:.1f}x its raw txn",
            figure=batch_t,
            baseline=raw_t,
            baseline_what="raw psycopg txn without the follow-up",
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
