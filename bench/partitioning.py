"""The inbox partitioned by day against the one plain inbox, on PostgreSQL (not in ``make test``).

    BENCH_INBOX_ROWS=10000000 BENCH_DAYS=10 IO_TEST_NAMESPACE=bench_partition \\
        .venv/bin/python -m bench.partitioning [fill|claims|retention|drop|all]

``fill`` creates two databases of its own (``<ns>_plain``, ``<ns>_parted``), migrates
them, fills each inbox with the same rows spread over ``BENCH_DAYS`` days (``INSERT
... SELECT generate_series``; one in 20,000 ``processing``, one in 10,000 ``failed``:
rows retention keeps) and converts the second with ``idempotent_orders_partitions convert``
(timed: the copy an operator plans downtime for). ``claims`` times new payments
consumed one by one (the one-statement road), in a caller's transaction (the
read-decide-write road) and by ``consume_batch``, in processes that alternate
between the two databases, plain first then partitioned, ``BENCH_ROUNDS`` times; each
figure is the median of the per-round ratios partitioned / plain. ``retention`` runs
``purge()`` three times on each database, a day apart (``now`` = 2, 1 and 0 days
back), alternating, then ``VACUUM`` on each (the ``DELETE``'s dead rows are the
vacuum's work; a dropped partition leaves none). ``drop`` drops both databases and
the run's Redis keys.
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
NS = os.environ.get("IO_TEST_NAMESPACE", "bench_partition")
PLAIN, PARTED = f"{NS}_plain", f"{NS}_parted"
ROWS = int(os.environ.get("BENCH_INBOX_ROWS", "1000000"))
DAYS = int(os.environ.get("BENCH_DAYS", "10"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "6"))
CLAIMS = int(os.environ.get("BENCH_CLAIMS", "300"))
PG = ["-h", "127.0.0.1", "-U", "postgres"]
TABLE = "idempotent_orders_processedmessage"


def _env(db: str) -> dict[str, str]:
    return {
        **os.environ,
        "BENCH_DB_NAME": db,
        "IO_TEST_NAMESPACE": NS,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "IO_TEST_PARTITIONED_INBOX": "1" if db == PARTED else "0",
        "PYTHONPATH": str(ROOT),
    }


def _psql(db: str, sql: str) -> str:
    out = subprocess.run(
        ["psql", *PG, "-d", db, "-v", "ON_ERROR_STOP=1", "-Atqc", sql],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def _child(db: str, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.partitioning", *args],
        cwd=ROOT,
        env=_env(db),
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


#: Oldest first, as a live inbox grows: ids rise with ``created_at``.
FILL = """
INSERT INTO idempotent_orders_processedmessage
  (consumer, message_id, message_type, status, outcome, order_id, seq, attempts,
   error, body, fingerprint, created_at, updated_at)
SELECT 'payments', md5(g::text)::uuid::text, 'payment.succeeded',
       CASE WHEN g % 20000 = 1 THEN 'processing' WHEN g % 10000 = 2 THEN 'failed'
       ELSE 'done' END,
       CASE WHEN g % 20000 = 1 OR g % 10000 = 2 THEN '' ELSE 'applied' END,
       NULL, NULL, 1, '', '', md5(g::text) || md5((g + 1)::text),
       now() - ({rows} - g)::bigint * {span} / {rows} * interval '1 second',
       now() - ({rows} - g)::bigint * {span} / {rows} * interval '1 second'
FROM generate_series(1, {rows}) g;
"""


def fill() -> None:
    for db in (PLAIN, PARTED):
        subprocess.run(["dropdb", *PG, "--if-exists", db], check=True)
        subprocess.run(["createdb", *PG, db], check=True)
        subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "migrate", "-v0"], env=_env(db), check=True
        )
    started = time.monotonic()
    _psql(PLAIN, FILL.format(rows=ROWS, span=DAYS * 86400))
    filled = time.monotonic() - started
    # The same rows: a copy of the plain table's, not a second generation.
    started = time.monotonic()
    subprocess.run(
        f"psql {' '.join(PG)} -d {PLAIN} -Atqc 'COPY {TABLE} TO STDOUT (FORMAT binary)' | "
        f"psql {' '.join(PG)} -d {PARTED} -Atqc 'COPY {TABLE} FROM STDIN (FORMAT binary)'",
        shell=True,
        check=True,
    )
    copied = time.monotonic() - started
    _psql(PARTED, f"SELECT setval(pg_get_serial_sequence('{TABLE}', 'id'), {ROWS + 1})")
    started = time.monotonic()
    subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "idempotent_orders_partitions", "convert"],
        env=_env(PARTED),
        check=True,
        capture_output=True,
    )
    converted = time.monotonic() - started
    for db in (PLAIN, PARTED):
        _psql(db, "VACUUM ANALYZE")
    print(
        json.dumps(
            {
                "rows": ROWS,
                "days": DAYS,
                "fill_s": round(filled, 1),
                "copy_s": round(copied, 1),
                "convert_s": round(converted, 1),
                "convert_rows_per_s": round(ROWS / converted),
                **sizes(),
            }
        )
    )


def sizes() -> dict[str, Any]:
    return {
        f"{label}_bytes": int(
            _psql(
                db,
                "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c"
                f" WHERE c.relname LIKE '{TABLE}%' AND c.relkind IN ('r', 'p')",
            )
            or 0
        )
        for label, db in (("plain", PLAIN), ("parted", PARTED))
    }


def _claims_child() -> None:
    """In the child: time CLAIMS new payments on each road; prints {road: seconds}."""
    import django

    django.setup()
    from django.db import connection, transaction

    from bench.common import make_orders, payment
    from idempotent_orders.consuming.batch import consume_batch
    from idempotent_orders.consuming.single import consume_message
    from idempotent_orders.consuming.sql import inbox_partitioned

    assert inbox_partitioned() == (connection.settings_dict["NAME"] == PARTED)
    tag = f"{time.time_ns()}"
    timings: dict[str, float] = {}
    roads = {
        "one statement": lambda m: consume_message(m, consumer="payments"),
        "read, decide, write": lambda m: _in_transaction(consume_message, transaction, m),
    }
    for road, consume in roads.items():
        label = road.replace(" ", "").replace(",", "")
        messages = [payment(o, f"{tag}-{label}") for o in make_orders(CLAIMS)]
        consume(payment(make_orders(1)[0], f"{tag}-{label}-warm"))
        started = time.perf_counter()
        for message in messages:
            consume(message)
        timings[road] = time.perf_counter() - started
    messages = [payment(o, f"{tag}-batch") for o in make_orders(CLAIMS)]
    started = time.perf_counter()
    for n in range(0, len(messages), 100):
        consume_batch(messages[n : n + 100], consumer="payments")
    timings["batch of 100"] = time.perf_counter() - started
    print(json.dumps(timings))


def _in_transaction(consume: Any, transaction: Any, message: Any) -> Any:
    with transaction.atomic():
        return consume(message, consumer="payments")


def claims() -> None:
    ratios: dict[str, list[float]] = {}
    per_claim: dict[str, dict[str, list[float]]] = {"plain": {}, "parted": {}}
    for _ in range(ROUNDS):
        plain = _child(PLAIN, "_claims")
        parted = _child(PARTED, "_claims")
        for road in plain:
            ratios.setdefault(road, []).append(parted[road] / plain[road])
            per_claim["plain"].setdefault(road, []).append(plain[road] / CLAIMS * 1e6)
            per_claim["parted"].setdefault(road, []).append(parted[road] / CLAIMS * 1e6)
    for road, values in ratios.items():
        print(
            f"{road:22} partitioned/plain median {statistics.median(values):.2f}"
            f" (rounds {', '.join(f'{v:.2f}' for v in values)});"
            f" plain {statistics.median(per_claim['plain'][road]):.0f} us/message,"
            f" partitioned {statistics.median(per_claim['parted'][road]):.0f} us/message"
        )


def _purge_child(days_back: str) -> None:
    import django

    django.setup()
    from datetime import timedelta

    from django.utils import timezone

    from idempotent_orders.retention import purge

    now = timezone.now() - timedelta(days=int(days_back))
    started = time.perf_counter()
    report = purge(now=now)
    print(json.dumps({"seconds": time.perf_counter() - started, "inbox": report.inbox}))


def retention() -> None:
    before = sizes()
    pairs = []
    for days_back in os.environ.get("BENCH_PURGE_DAYS", "2,1,0").split(","):
        plain = _child(PLAIN, "_purge", days_back)
        parted = _child(PARTED, "_purge", days_back)
        pairs.append((days_back, plain, parted))
        print(
            f"purge now-{days_back}d: DELETE {plain['inbox']} rows in {plain['seconds']:.2f} s,"
            f" DROP ~{parted['inbox']} rows in {parted['seconds']:.2f} s,"
            f" ratio DROP/DELETE {parted['seconds'] / plain['seconds']:.4f};"
            f" per million rows: DELETE {plain['seconds'] / max(plain['inbox'], 1) * 1e6:.1f} s,"
            f" DROP {parted['seconds'] / max(parted['inbox'], 1) * 1e6:.2f} s"
        )
    vacuum = {}
    for label, db in (("plain", PLAIN), ("parted", PARTED)):
        started = time.monotonic()
        _psql(db, f"VACUUM {TABLE}")
        vacuum[label] = time.monotonic() - started
    print(f"VACUUM afterwards: plain {vacuum['plain']:.2f} s, partitioned {vacuum['parted']:.2f} s")
    kept = _psql(PARTED, f"SELECT count(*) FROM {TABLE}_kept")
    print(f"kept rows moved to the default partition: {kept}")
    print(json.dumps({"before": before, "after": sizes()}))


def drop() -> None:
    for db in (PLAIN, PARTED):
        subprocess.run(["dropdb", *PG, "--if-exists", db], check=True)
    subprocess.run(
        f"redis-cli --scan --pattern '{NS}*' | xargs -r -d '\\n' -n 1000 redis-cli unlink",
        shell=True,
        check=True,
        capture_output=True,
    )


def main(argv: list[str]) -> None:
    action = argv[1] if len(argv) > 1 else "all"
    if action == "_claims":
        _claims_child()
    elif action == "_purge":
        _purge_child(argv[2])
    elif action == "all":
        fill()
        claims()
        retention()
        drop()
    else:
        {"fill": fill, "claims": claims, "retention": retention, "drop": drop}[action]()


if __name__ == "__main__":
    main(sys.argv)
