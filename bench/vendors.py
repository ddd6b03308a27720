"""Section 1b: the consumer on MariaDB and SQLite, each beside its own raw transaction.

Each vendor runs in a child process (``python -m bench.vendors mariadb``), since the
database is chosen when the settings load. The baseline is the driver by hand, as on
PostgreSQL: BEGIN; INSERT the inbox row; the conditional UPDATE; COMMIT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import ROOT, RUNS, Row, fmt, median, na
from bench.consumer import BATCH, N

VENDORS = ("mariadb", "sqlite")


def _fresh_database(vendor: str) -> None:
    """An empty benchmark database of ``vendor`` (PostgreSQL's is made by ``setup``)."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    if vendor == "mariadb":
        import MySQLdb

        admin = MySQLdb.connect(
            host=db["HOST"] or "127.0.0.1",
            port=int(db["PORT"] or 3306),
            user=db["USER"] or "root",
            passwd=db["PASSWORD"] or "",
        )
        try:
            cur = admin.cursor()
            cur.execute(f"DROP DATABASE IF EXISTS `{db['NAME']}`")
            # Case- and pad-sensitive, as message ids need (and as the tests run).
            cur.execute(
                f"CREATE DATABASE `{db['NAME']}` CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin"
            )
        finally:
            admin.close()
    else:
        for suffix in ("", "-wal", "-shm"):
            Path(str(db["NAME"]) + suffix).unlink(missing_ok=True)


def _raw(orders: list[Any], tag: str, vendor: str) -> None:
    """The driver by hand: one explicit transaction per message."""
    from django.db import connection

    from idempotent_orders.models import Order, ProcessedMessage

    inbox, table = ProcessedMessage._meta.db_table, Order._meta.db_table
    p = "%s" if vendor == "mariadb" else "?"
    now = "now(6)" if vendor == "mariadb" else "datetime('now')"
    insert = (
        f"INSERT INTO {inbox} (consumer, message_id, message_type, status, outcome,"
        f" order_id, attempts, error, body, created_at, updated_at)"
        f" VALUES ({p}, {p}, {p}, 'done', 'applied', {p}, 1, '', '', {now}, {now})"
    )
    update = (
        f"UPDATE {table} SET status = 'paid', version = version + 1, payment_id = {p},"
        f" updated_at = {now} WHERE id = {p} AND status IN ('pending_payment')"
        f" AND version = {p}"
    )
    raw = connection.connection
    cur = raw.cursor()
    for order in orders:
        cur.execute("BEGIN")
        cur.execute(insert, ("raw", f"pay-{tag}{order.pk}", "payment.succeeded", order.pk))
        cur.execute(update, (f"p{order.pk}", order.pk, order.version))
        raw.commit() if vendor == "mariadb" else cur.execute("COMMIT")
    cur.close()


def child(vendor: str) -> None:
    """Measure on ``vendor`` and print the medians as JSON (run in its own process)."""
    os.environ["IO_TEST_DATABASE"] = vendor
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    sys.path.insert(0, str(ROOT))
    import django
    from django.conf import settings

    settings.DATABASES  # noqa: B018 - load the settings before django.setup()
    _fresh_database(vendor)
    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0, interactive=False)
    from bench.common import make_orders, payment, rate
    from bench.consumer import in_batches, one_by_one

    connection.ensure_connection()
    raw_rates, new_rates, batch_rates = [], [], []
    for run_no in range(RUNS):
        orders = make_orders(N)
        raw_rates.append(rate(N, lambda o=orders, t=f"r{run_no}-": _raw(o, t, vendor)))
        orders = make_orders(N)
        messages = [payment(o, f"s{run_no}-") for o in orders]
        new_rates.append(rate(N, lambda m=messages: one_by_one(m)))
        orders = make_orders(N)
        messages = [payment(o, f"b{run_no}-") for o in orders]
        batch_rates.append(rate(N, lambda m=messages: in_batches(m)))
    print(
        json.dumps(
            {"raw": median(raw_rates), "new": median(new_rates), "batch": median(batch_rates)}
        )
    )


def run() -> list[Row]:
    rows: list[Row] = []
    for vendor in VENDORS:
        section = f"1b consumer ({'MariaDB' if vendor == 'mariadb' else 'SQLite'}, 1 proc)"
        # The bench settings as they load (the test settings): the follow-up off.
        road = "NON-DEFAULT (FULFIL_AFTER_PAYMENT=False)"
        env = {**os.environ, "IO_TEST_DATABASE": vendor}
        done = subprocess.run(
            [sys.executable, "-m", "bench.vendors", vendor],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append(na(section, "consumer", tail[:100]))
            continue
        got = json.loads(done.stdout.strip().splitlines()[-1])
        raw, new, batch = got["raw"], got["new"], got["batch"]
        rows += [
            Row(section, "raw driver INSERT+UPDATE txn", fmt(raw), "the limit on this database"),
            Row(section, f"settings: {road}", "", "raw: the inbox row and the UPDATE only"),
            Row(
                section,
                f"{road}: consume_message, new",
                fmt(new),
                f"{new / raw:.0%} of raw",
                figure=new,
                baseline=raw,
                baseline_what=f"raw {vendor} txn",
            ),
            Row(
                section,
                f"{road}: consume_batch, new, {BATCH}/batch",
                fmt(batch),
                f"{batch / raw:.1f}x raw",
                figure=batch,
                baseline=raw,
                baseline_what=f"raw {vendor} txn",
            ),
        ]
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in VENDORS:
        child(sys.argv[1])
    else:
        from bench.common import print_table, setup

        setup()
        print_table(run())
