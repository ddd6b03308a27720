"""Section 1b: the consumer on MariaDB and SQLite, each beside its own raw transaction.

Each vendor runs in a child process (``python -m bench.vendors mariadb``), since the
database is chosen when the settings load. The default configuration first (the
fulfilment follow-up on): beside the driver by hand doing the same writes (BEGIN; the
inbox row; the conditional UPDATE; the follow-up's outbox row; COMMIT), and with the
spent payment too (every write ``consume_message`` makes). Then the tuned road, labelled
``NON-DEFAULT``, beside BEGIN; the inbox row; the UPDATE; COMMIT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import ROOT, RUNS, Row, fmt, median, na
from bench.consumer import BATCH, HELD, N, held_label

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


def _raw(orders: list[Any], tag: str, vendor: str, writes: tuple[str, ...]) -> None:
    """The driver by hand: one explicit transaction per message, with ``writes`` of
    ``inbox`` (the inbox row), ``spent`` (the spent payment), ``update`` (the conditional
    UPDATE of state and version) and ``outbox`` (the fulfilment follow-up's row)."""
    from django.db import connection

    from idempotent_orders.models import Order, OutboxMessage, ProcessedMessage, SpentPayment

    inbox, table = ProcessedMessage._meta.db_table, Order._meta.db_table
    spent, outbox = SpentPayment._meta.db_table, OutboxMessage._meta.db_table
    p = "%s" if vendor == "mariadb" else "?"
    now = "now(6)" if vendor == "mariadb" else "datetime('now')"
    texts = {
        "inbox": (
            f"INSERT INTO {inbox} (consumer, message_id, message_type, status, outcome,"
            f" order_id, attempts, error, body, fingerprint, created_at, updated_at)"
            f" VALUES ({p}, {p}, {p}, 'done', 'applied', {p}, 1, '', '', {p}, {now}, {now})"
        ),
        "spent": (
            f"INSERT INTO {spent} (payment_id, order_id, consumer, message_id, created_at)"
            f" VALUES ({p}, {p}, 'raw', {p}, {now})"
        ),
        "update": (
            f"UPDATE {table} SET status = 'paid', version = version + 1, payment_id = {p},"
            f" updated_at = {now} WHERE id = {p} AND status IN ('pending_payment')"
            f" AND version = {p}"
        ),
        "outbox": (
            f"INSERT INTO {outbox} (message_id, task_name, payload, options, status, attempts,"
            f" last_error, order_key, traceparent, correlation_id, available_at, created_at)"
            f" VALUES ({p}, 'idempotent_orders.fulfil_order', {p}, '{{}}', 'pending', 0, '',"
            f" {p}, '', '', {now}, {now})"
        ),
    }
    raw = connection.connection
    cur = raw.cursor()
    for order in orders:
        pk, message_id = order.pk, f"pay-{tag}{order.pk}"
        args = {
            "inbox": ("raw", message_id, "payment.succeeded", pk, "f" * 64),
            "spent": (f"raw-{tag}{pk}", pk, message_id),
            "update": (f"p{pk}", pk, order.version),
            "outbox": (f"raw-fulfil-{tag}{pk}", str(pk), str(pk)),
        }
        cur.execute("BEGIN")
        for write in writes:
            cur.execute(texts[write], args[write])
        raw.commit() if vendor == "mariadb" else cur.execute("COMMIT")
    cur.close()


#: The raw baselines: the writes the issue names (the inbox row, the UPDATE, the
#: follow-up's outbox row), every write ``consume_message`` makes (the spent payment
#: too), and the tuned road's (the inbox row and the UPDATE).
RAW = {
    "raw3": ("inbox", "update", "outbox"),
    "raw4": ("inbox", "spent", "update", "outbox"),
    "raw2": ("inbox", "update"),
}


def child(vendor: str) -> None:
    """Measure on ``vendor`` and print the medians as JSON (run in its own process).

    Interleaved run by run: each raw baseline, then the road it stands beside. With
    ``BENCH_VENDORS_ORM_ROAD=1`` the general road (the one-transaction road off: Django's
    ``atomic`` and the ORM) is measured in the same runs too, on the default configuration.
    """
    setup_child(vendor)
    from unittest import mock

    from django.db import connection
    from django.test import override_settings

    from bench.common import make_orders, payment, rate
    from bench.consumer import RUN_TAG, default_configuration, differences, in_batches, one_by_one
    from idempotent_orders.consuming.backends import at_once
    from idempotent_orders.outbox import flush_publisher

    orm_road = os.environ.get("BENCH_VENDORS_ORM_ROAD") == "1"
    connection.ensure_connection()
    config = default_configuration()
    tuned = {**config, "FULFIL_AFTER_PAYMENT": False}
    rates: dict[str, list[float]] = {
        k: [] for k in (*RAW, "new", "held", "batch", "new_t", "batch_t", "orm")
    }

    def consumed(key: str, conf: dict[str, Any], tag: str, batch: bool = False) -> None:
        messages = [payment(o, f"{RUN_TAG}{tag}") for o in make_orders(N)]
        with override_settings(IDEMPOTENT_ORDERS=conf):
            run = in_batches if batch else one_by_one
            rates[key].append(rate(N, lambda: run(messages)))
            flush_publisher()  # this run's follow-ups are not published during the next

    for run_no in range(RUNS):
        for key, writes in RAW.items():
            orders = make_orders(N)
            tag = f"{RUN_TAG}{key}{run_no}-"
            rates[key].append(rate(N, lambda o=orders, t=tag, w=writes: _raw(o, t, vendor, w)))
            if key == "raw4":
                consumed("new", config, f"s{run_no}-")
                consumed("held", {**config, **HELD}, f"h{run_no}-")
                if orm_road:
                    with mock.patch.object(at_once, "can_apply_unread_at_once", return_value=False):
                        consumed("orm", config, f"o{run_no}-")
                consumed("batch", config, f"b{run_no}-", batch=True)
            elif key == "raw2":
                consumed("new_t", tuned, f"t{run_no}-")
                consumed("batch_t", tuned, f"u{run_no}-", batch=True)
    got: dict[str, Any] = {k: median(v) for k, v in rates.items() if v}
    got["settings"] = differences(config)
    got["tuned"] = sorted(set(differences(tuned)) - set(got["settings"]))
    print(json.dumps(got))


def profile(vendor: str, cprofile: bool) -> None:
    """``python -m bench.vendors <vendor> --profile [--cprofile]``: the default road's
    statements and round trips per new message, now and on the previous road (Django's
    ``atomic`` and the ORM), and where the time goes.

    MariaDB: every request the client sends (``query``, ``commit``, ``rollback``,
    ``autocommit``) is one round trip. SQLite: every statement the library runs
    (``set_trace_callback``); there is no round trip, the statements' own work is timed.
    """
    import cProfile
    import pstats
    import time
    from unittest import mock

    setup_child(vendor)
    from django.db import connection
    from django.test import override_settings

    from bench.common import make_orders, payment
    from bench.consumer import RUN_TAG, default_configuration, one_by_one
    from idempotent_orders.consuming.backends import at_once
    from idempotent_orders.outbox import flush_publisher

    config = default_configuration()
    sent: list[str] = []
    connection.ensure_connection()
    raw = connection.connection
    if vendor == "mariadb":
        import MySQLdb.connections

        cls = MySQLdb.connections.Connection
        for name in ("query", "commit", "rollback", "autocommit"):
            real = getattr(cls, name)

            def counted(self: Any, *args: Any, _real: Any = real, _name: str = name) -> Any:
                if self is raw:  # the consumer's connection, not the publisher thread's
                    sent.append(_name if _name != "query" else args[0][:24].decode())
                return _real(self, *args)

            setattr(cls, name, counted)
    else:
        raw.set_trace_callback(lambda sql: sent.append(sql[:24]))
    previous = (mock.patch.object(at_once, "can_apply_unread_at_once", return_value=False),)
    with override_settings(IDEMPOTENT_ORDERS=config):
        one_by_one([payment(o, f"{RUN_TAG}w-") for o in make_orders(20)])  # warm up
        flush_publisher()
        for road in ("now", "previous"):
            patches = previous if road == "previous" else ()
            for patch in patches:
                patch.start()
            try:
                messages = [payment(o, f"{RUN_TAG}{road}-") for o in make_orders(N)]
                sent.clear()
                profiler = cProfile.Profile() if cprofile else None
                began = time.perf_counter()
                if profiler is not None:
                    profiler.enable()
                one_by_one(messages)
                if profiler is not None:
                    profiler.disable()
                elapsed = time.perf_counter() - began
                flush_publisher()
            finally:
                for patch in patches:
                    patch.stop()
            what = "round trips" if vendor == "mariadb" else "statements"
            print(f"{vendor}, {road} road: {len(sent) / N:.2f} {what} per new message,")
            print(f"  {elapsed / N * 1e3:.3f} ms per message; one message's, in order:")
            per = len(sent) // N
            print("  " + " | ".join(s.split(" (")[0].strip() for s in sent[-per:]))
            if profiler is not None:
                pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def setup_child(vendor: str) -> None:
    """Django on a fresh, migrated benchmark database of ``vendor``."""
    os.environ["IO_TEST_DATABASE"] = vendor
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    sys.path.insert(0, str(ROOT))
    import django
    from django.conf import settings

    settings.DATABASES  # noqa: B018 - load the settings before django.setup()
    _fresh_database(vendor)
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)


def run() -> list[Row]:
    rows: list[Row] = []
    for vendor in VENDORS:
        name = "MariaDB" if vendor == "mariadb" else "SQLite"
        driver = "mysqlclient" if vendor == "mariadb" else "sqlite3"
        section = f"1b consumer ({name}, 1 proc)"
        env = {**os.environ, "IO_TEST_DATABASE": vendor}
        done = subprocess.run(
            [sys.executable, "-m", "bench.vendors", vendor],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append(na(section, "consumer", tail[:100]))
            continue
        got = json.loads(done.stdout.strip().splitlines()[-1])
        raw3, raw4, raw2 = got["raw3"], got["raw4"], got["raw2"]
        new, batch = got["new"], got["batch"]
        target = 0.8 if vendor == "mariadb" else 0.5
        tuned = f"NON-DEFAULT ({', '.join(got['tuned'])})"
        rows += [
            Row(
                section, "settings not at their defaults", "", ", ".join(got["settings"]) or "none"
            ),
            Row(section, f"raw {driver} txn: inbox + UPDATE + outbox row", fmt(raw3), ""),
            Row(
                section,
                f"raw {driver} txn: inbox + spent payment + UPDATE + outbox row",
                fmt(raw4),
                "every write consume_message makes",
            ),
            Row(
                section,
                "consume_message, new",
                fmt(new),
                f"{new / raw4:.2f}x raw, the same writes (target >= {target});"
                f" {new / raw3:.2f}x raw without the spent payment",
                figure=new,
                baseline=raw4,
                baseline_what=f"raw {driver} txn, the same writes",
            ),
        ]
        if "held" in got:
            held = got["held"]
            rows.append(
                Row(
                    section,
                    f"{held_label()}: consume_message, new",
                    fmt(held),
                    f"{held / raw4:.2f}x raw, the same writes",
                    figure=held,
                    baseline=raw4,
                    baseline_what=f"raw {driver} txn, the same writes",
                )
            )
        if "orm" in got:
            orm = got["orm"]
            rows.append(
                Row(
                    section,
                    "general road (Django's atomic and the ORM), new",
                    fmt(orm),
                    f"{orm / raw4:.2f}x raw; the one-transaction road {new / orm:.1f}x it",
                )
            )
        rows += [
            Row(
                section,
                f"consume_batch, new, {BATCH}/batch",
                fmt(batch),
                f"{batch / raw4:.1f}x raw, the same writes",
                figure=batch,
                baseline=raw4,
                baseline_what=f"raw {driver} txn, the same writes",
            ),
            Row(section, f"{tuned}: raw {driver} txn: inbox + UPDATE", fmt(raw2), ""),
            Row(
                section,
                f"{tuned}: consume_message, new",
                fmt(got["new_t"]),
                f"{got['new_t'] / raw2:.2f}x its raw txn",
                figure=got["new_t"],
                baseline=raw2,
                baseline_what=f"raw {driver} txn, inbox + UPDATE",
            ),
            Row(
                section,
                f"{tuned}: consume_batch, new, {BATCH}/batch",
                fmt(got["batch_t"]),
                f"{got['batch_t'] / raw2:.1f}x its raw txn",
            ),
        ]
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in VENDORS and "--profile" in sys.argv:
        profile(sys.argv[1], "--cprofile" in sys.argv)
    elif len(sys.argv) > 1 and sys.argv[1] in VENDORS:
        child(sys.argv[1])
    else:
        from bench.common import print_table, setup

        setup()
        print_table(run())
