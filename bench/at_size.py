"""The admin and the process start at size, on PostgreSQL (not part of ``make test``).

    BENCH_INBOX_ROWS=2000000 BENCH_ORDERS=2000000 .venv/bin/python bench/at_size.py

Creates two databases of its own (``size_<ns>`` filled, ``size_<ns>_empty``), migrates
them, fills one with ``INSERT ... SELECT generate_series`` and times, through Django's test ``Client`` logged in as a
superuser, the admin pages an operator opens, ``outbox_stats()`` and the Bloom
filter's warm-up at process start (``BENCH_PARTS=admin``); and a fresh worker that
consumes ``BENCH_FRESH_MESSAGES`` (1,000) new payments from its first message, its
filter loaded from the snapshot another process wrote, and without a snapshot
(``BENCH_PARTS=worker``; both by default). Each figure is also given as a ratio to the
same measurement on the empty database, taken in the same run: the two alternate
``BENCH_ROUNDS`` times (3), medians (a rate's ratio is the full database's rate over
the empty one's). The databases are dropped at the end unless
``BENCH_KEEP=1``; a run that finds a kept database migrates it and measures again. At
10M inbox rows (``BENCH_INBOX_ROWS=10000000``) the fill takes about 7 minutes here
and the databases about 5 GB.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NS = os.environ.get("IO_TEST_NAMESPACE", "bench")
FULL = os.environ.get("BENCH_DB", f"size_{NS}")
EMPTY = f"{FULL}_empty"
INBOX = int(os.environ.get("BENCH_INBOX_ROWS", "2000000"))
ORDERS = int(os.environ.get("BENCH_ORDERS", "2000000"))
OUTBOX = int(os.environ.get("BENCH_OUTBOX_ROWS", str(max(INBOX // 10, 1000))))
PARKED = int(os.environ.get("BENCH_PARKED_ROWS", "10000"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "5"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
FRESH = int(os.environ.get("BENCH_FRESH_MESSAGES", "1000"))
PARTS = set(os.environ.get("BENCH_PARTS", "admin,worker").split(","))
#: The fresh worker's configurations: the default (a snapshot written by another process
#: before it starts), no snapshot (the window read from the inbox, paced), and, for the
#: floor the database's size sets, the filter loaded from the snapshot before the clock.
WORKER_MODES = {
    "snapshot": {},
    "no snapshot": {"DEDUP_BLOOM_SNAPSHOT": False},
    "filter loaded before the clock": {},
}
PG = ["-h", "127.0.0.1", "-U", "postgres"]


def _env(db: str) -> dict[str, str]:
    return {
        **os.environ,
        "IO_TEST_DATABASE": "postgres",
        "IO_TEST_DB_NAME": db,
        "IO_WORKER_DB": "1",
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": str(ROOT),
    }


def _manage(db: str, *args: str) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args, "-v0"], env=_env(db), check=True
    )


def _psql(db: str, sql: str) -> str:
    out = subprocess.run(
        ["psql", *PG, "-d", db, "-v", "ON_ERROR_STOP=1", "-Atc", sql],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


FILL = """
INSERT INTO idempotent_orders_order
  (business_key, amount, currency, status, payment_id, tracking_number, carrier,
   created_at, updated_at, version, last_seq, has_parked)
SELECT 'order-' || g, 19.90, 'EUR',
       (ARRAY['pending_payment','paid','shipped','completed'])[1 + g % 4],
       'pay-' || g, '', '', now() - (g % 172800) * interval '1 second',
       now() - (g % 172800) * interval '1 second', 2, 0, false
FROM generate_series(1, {orders}) g;

INSERT INTO idempotent_orders_processedmessage
  (consumer, message_id, message_type, status, outcome, order_id, seq, attempts,
   error, body, fingerprint, created_at, updated_at)
SELECT (ARRAY['payments','shipping'])[1 + g % 2],
       md5(g::text)::uuid::text,
       (ARRAY['payment.succeeded','shipment.dispatched'])[1 + g % 2],
       'done', (ARRAY['applied','applied','applied','duplicate'])[1 + g % 4],
       1 + g % {orders}, NULL, 1, '', '', md5(g::text) || md5((g + 1)::text),
       now() - (g % 172800) * interval '1 second',
       now() - (g % 172800) * interval '1 second'
FROM generate_series(1, {inbox}) g;

-- What an operator looks for: stuck, failed, dead, rejected (a few thousand in all).
UPDATE idempotent_orders_processedmessage SET status = 'processing', outcome = '',
       lease_expires_at = now() - interval '10 minutes' WHERE id % 20000 = 1;
UPDATE idempotent_orders_processedmessage SET status = 'failed', outcome = 'failed',
       error = 'boom' WHERE id % 10000 = 2;
UPDATE idempotent_orders_processedmessage SET status = 'dead', dead_at = now(),
       error = 'boom' WHERE id % 50000 = 3;
UPDATE idempotent_orders_processedmessage SET status = 'rejected', outcome = 'rejected',
       error = 'not allowed' WHERE id % 1000 = 4;

INSERT INTO idempotent_orders_parkedmessage
  (consumer, message_id, order_id, seq, envelope, reason, parked_at)
SELECT 'shipping', 'parked-' || md5(g::text), g, 2, '{{}}'::jsonb, 'waiting for seq 1',
       now() - (g % 7200) * interval '1 second'
FROM generate_series(1, {parked}) g;

INSERT INTO idempotent_orders_outboxmessage
  (message_id, task_name, payload, options, status, attempts, available_at, last_error,
   created_at, sent_at, order_key, traceparent, correlation_id)
SELECT md5('o' || g)::uuid::text, 'shop.tasks.ship', '{{"order": 1}}'::jsonb,
       '{{}}'::jsonb, CASE WHEN g % 1000 = 0 THEN 'pending' WHEN g % 10000 = 1
       THEN 'dead' ELSE 'sent' END, CASE WHEN g % 500 = 0 THEN 1 ELSE 0 END,
       now(), '', now() - (g % 172800) * interval '1 second', now(), 'order-' || g, '', ''
FROM generate_series(1, {outbox}) g;
"""


def setup() -> None:
    for db in (FULL, EMPTY):
        subprocess.run(["dropdb", *PG, "--if-exists", db], check=True)
        subprocess.run(["createdb", *PG, db], check=True)
        _manage(db, "migrate")
    started = time.perf_counter()
    _psql(FULL, FILL.format(orders=ORDERS, inbox=INBOX, parked=PARKED, outbox=OUTBOX))
    _psql(FULL, "VACUUM ANALYZE")
    print(f"filled {FULL} in {time.perf_counter() - started:.0f} s", file=sys.stderr)


def migrate_kept() -> None:
    for db in (FULL, EMPTY):
        started = time.perf_counter()
        _manage(db, "migrate")
        _psql(db, "VACUUM ANALYZE")
        print(f"migrated {db} in {time.perf_counter() - started:.0f} s", file=sys.stderr)


def sizes(db: str) -> dict[str, Any]:
    rows = int(_psql(db, "SELECT count(*) FROM idempotent_orders_processedmessage"))
    total = int(_psql(db, "SELECT pg_total_relation_size('idempotent_orders_processedmessage')"))
    indexes = int(_psql(db, "SELECT pg_indexes_size('idempotent_orders_processedmessage')"))
    each = _psql(
        db,
        "SELECT indexrelid::regclass || '=' || pg_relation_size(indexrelid) FROM pg_index "
        "WHERE indrelid = 'idempotent_orders_processedmessage'::regclass",
    )
    return {
        "inbox_rows": rows,
        "bytes_per_row": round(total / rows, 1) if rows else None,
        "index_bytes_per_row": round(indexes / rows, 1) if rows else None,
        "indexes": dict(line.split("=") for line in each.splitlines()),
    }


# -- run inside a child process, on one database ---------------------------------------


def measure() -> dict[str, float]:
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext, setup_test_environment

    from idempotent_orders import dedup
    from idempotent_orders.models import (
        ProcessedMessage,
    )
    from idempotent_orders.outbox import outbox_stats

    setup_test_environment()

    user_model = get_user_model()
    user = user_model.objects.filter(username="bench-admin").first()
    if user is None:
        user = user_model.objects.create_superuser("bench-admin", "a@example.com", "x")
    client = Client()
    client.force_login(user)
    message_id = (
        ProcessedMessage.objects.order_by("id").values_list("message_id", flat=True).first()
        or "none"
    )
    order_pk = ProcessedMessage.objects.order_by("id").values_list("order_id", flat=True).first()
    inbox = "/admin/idempotent_orders/processedmessage/"
    pages = {
        "inbox list": inbox,
        "inbox stuck": inbox + "?attention=stuck",
        "inbox failed": inbox + "?attention=failed",
        "inbox dead": inbox + "?attention=dead",
        "inbox outcome=applied": inbox + "?outcome__exact=applied",
        "inbox search order id": inbox + f"?q={order_pk or 1}",
        "inbox search message id": inbox + f"?q={message_id}",
        "inbox page 50": inbox + "?p=50",
        "parked list": "/admin/idempotent_orders/parkedmessage/",
        "parked search message id": "/admin/idempotent_orders/parkedmessage/?q=parked-x",
        "outbox list": "/admin/idempotent_orders/outboxmessage/",
        "outbox pending": "/admin/idempotent_orders/outboxmessage/?status__exact=pending",
        "orders search business key": "/admin/idempotent_orders/order/?q=order-17",
        "dashboard /admin/": "/admin/",
    }
    out: dict[str, float] = {}

    def timed(name: str, call: Any) -> None:
        call()  # warm: caches, plans
        runs, sql = [], []
        for _ in range(REPEAT):
            with CaptureQueriesContext(connection) as queries:
                started = time.perf_counter()
                call()
                runs.append(time.perf_counter() - started)
            sql.append(sum(float(q["time"]) for q in queries.captured_queries))
        out[name] = statistics.median(runs) * 1000
        out[f"{name} [SQL]"] = statistics.median(sql) * 1000

    for name, url in pages.items():

        def get(url: str = url) -> None:
            response = client.get(url)
            assert response.status_code == 200, (url, response.status_code)

        timed(name, get)
    timed("outbox_stats()", lambda: outbox_stats())
    connection.close()

    # Process start: the first lookup of a fresh process (its filter empty), with the
    # default window (24 h): loading it first (the only way before), or in the background.
    from django.conf import settings
    from django.test import override_settings

    def first_lookup() -> None:
        dedup.reset()
        dedup.lookup("payments", "never-seen")

    for background in (False, True):
        values = {
            **settings.IDEMPOTENT_ORDERS,
            "DEDUP_WINDOW": 24 * 3600,
            "DEDUP_BLOOM_WARM_UP_IN_BACKGROUND": background,
            "DEDUP_BLOOM_SNAPSHOT": False,  # the window from the inbox, as it says
        }
        with override_settings(IDEMPOTENT_ORDERS=values):
            runs = []
            for _ in range(REPEAT):
                started = time.perf_counter()
                first_lookup()
                runs.append(time.perf_counter() - started)
                dedup.bloom.wait_warm(600)  # not timed: the load goes on behind the lookups
            how = "in the background" if background else "loading the window first"
            out[f"process start, first lookup: {how}"] = statistics.median(runs) * 1000
    return out


def write_snapshot() -> dict[str, float]:
    """What a worker already running does: load the window and write the snapshot."""
    import django

    django.setup()
    from django.test import override_settings

    from bench.consumer import default_configuration
    from idempotent_orders import dedup

    with override_settings(IDEMPOTENT_ORDERS=default_configuration()):
        started = time.perf_counter()
        rows = dedup.bloom.rebuild()
        loaded = time.perf_counter()
        assert dedup.bloom.write_snapshot()
    return {
        "rows": rows,
        "load_s": loaded - started,
        "write_s": time.perf_counter() - loaded,
    }


def fresh_worker(mode: str) -> dict[str, float]:
    """A new process consumes ``FRESH`` new payments one by one, timed from the first, in
    the default configuration (``WORKER_MODES`` changes one setting or none)."""
    import uuid

    import django

    django.setup()
    from django.test import override_settings

    from bench.common import make_orders, payment
    from bench.consumer import default_configuration
    from idempotent_orders import dedup
    from idempotent_orders.consuming.single import consume_message

    orders = make_orders(FRESH)  # before the clock: the worker's first message is next
    tag = uuid.uuid4().hex[:8]
    messages = [payment(order, f"{tag}-") for order in orders]
    # The app's defaults (the test settings shorten the window and load it first).
    values = {**default_configuration(), **WORKER_MODES[mode]}
    times: list[float] = []
    warming = 0
    clock = time.perf_counter
    with override_settings(IDEMPOTENT_ORDERS=values):
        if mode == "filter loaded before the clock":
            dedup.bloom.warm_up()
            dedup.bloom.wait_warm(600)
        started = clock()
        for message in messages:
            began = clock()
            consume_message(message, consumer="payments")
            times.append(clock() - began)
            warming += dedup.bloom.warming
        elapsed = clock() - started
        dedup.bloom.wait_warm(600)
        loaded = clock() - started
        dedup.bloom.wait_snapshot(600)
    cuts = statistics.quantiles(times, n=100)
    return {
        f"fresh worker, {mode}: msg/s": FRESH / elapsed,
        f"fresh worker, {mode}: p50 ms": cuts[49] * 1000,
        f"fresh worker, {mode}: p99 ms": cuts[98] * 1000,
        f"fresh worker, {mode}: messages while loading": warming,
        f"fresh worker, {mode}: s until the filter answers": loaded,
    }


def _child(db: str, *args: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, __file__, *args],
        env=_env(db),
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def report() -> dict[str, Any]:
    # Full and empty alternate, ROUNDS times (medians): on a shared machine the load
    # moves between two children run one after the other.
    runs: dict[str, list[dict[str, float]]] = {FULL: [], EMPTY: []}
    if "worker" in PARTS:
        for db in (FULL, EMPTY):
            prepared = _child(db, "--write-snapshot")
            print(f"snapshot of {db}: {prepared}", file=sys.stderr)
    for round_no in range(ROUNDS):
        # Each fresh worker on the full database right beside the same on the empty one,
        # which goes first every other round: their ratio is the round's figure.
        order = (FULL, EMPTY) if round_no % 2 == 0 else (EMPTY, FULL)
        figures: dict[str, dict[str, float]] = {FULL: {}, EMPTY: {}}
        if "admin" in PARTS:
            for db in order:
                figures[db].update(_child(db, "--measure"))
        if "worker" in PARTS:
            for mode in WORKER_MODES:
                for db in order:
                    figures[db].update(_child(db, "--fresh-worker", mode))
        for db in (FULL, EMPTY):
            print(f"{db}: {json.dumps(figures[db])}", file=sys.stderr)
            runs[db].append(figures[db])
    full, empty = (
        {k: statistics.median(r[k] for r in runs[db]) for k in runs[db][0]} for db in (FULL, EMPTY)
    )
    pairs = {
        k: [f[k] / e[k] for f, e in zip(runs[FULL], runs[EMPTY], strict=True) if e[k]] for k in full
    }
    result = {
        "sizes": sizes(FULL),
        "ms": {k: round(v, 1) for k, v in full.items()},
        "empty_ms": {k: round(v, 1) for k, v in empty.items()},
        "ratio": {k: round(full[k] / empty[k], 2) for k in full if empty.get(k)},
        # The median of the rounds' own ratios (the fresh workers': a rate's is the full
        # database's over the empty one's, measured side by side).
        "round_ratios": {k: [round(r, 2) for r in v] for k, v in pairs.items() if v},
        "median_round_ratio": {k: round(statistics.median(v), 2) for k, v in pairs.items() if v},
    }
    print(json.dumps(result, indent=1))
    return result


def main() -> None:
    if sys.argv[1:2] == ["--measure"]:
        print(json.dumps(measure()))
        return
    if sys.argv[1:2] == ["--write-snapshot"]:
        print(json.dumps(write_snapshot()))
        return
    if sys.argv[1:2] == ["--fresh-worker"]:
        print(json.dumps(fresh_worker(sys.argv[2])))
        return
    if _psql("postgres", f"SELECT 1 FROM pg_database WHERE datname='{FULL}'"):
        migrate_kept()
    else:
        setup()
    report()
    if os.environ.get("BENCH_KEEP") != "1":
        for db in (FULL, EMPTY):
            subprocess.run(["dropdb", *PG, "--if-exists", db], check=True)


if __name__ == "__main__":
    # Run as a script, bench/ would come first on the path (and bench/http.py shadow http).
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench")]
    main()
