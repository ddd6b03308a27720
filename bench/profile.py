"""Where a new message's time goes on the default road: ``python -m bench.profile``.

Runs ``BENCH_PROFILE_MESSAGES`` (400) new payments through ``consume_message`` (or,
with ``--batch``, ``consume_batch``) on PostgreSQL with the default configuration
(the fulfilment follow-up on, the Redis fast path on), on the app's Order, or with
``--shop`` on the demo's ShopOrder (transition bodies; its own database and
settings, ``bench.settings_shop``). Prints each step's share of a message's time in
the consuming thread, the statements and round trips per message (libpq's protocol
trace: every ``Query`` or ``Sync`` the client sends is one round trip), and the same
for the outbox publisher thread. ``--cprofile`` adds cProfile's top functions.

``--save``: on the save() road (a ``post_save`` receiver that does nothing connected to
the order model, as section 1's save() road row runs it).

``--duplicates``: where a duplicate's time goes instead, on the default configuration
(``bench.consumer.default_configuration``, as section 1 runs it; ``--batch``: through
``consume_batch``, new messages and copies alike; ``--elsewhere``: the copies arrive as
at another process, this one's memory of them forgotten, so Redis answers). ``BENCH_RUNS`` (3)
rounds of N new messages then their N copies, each round timed without wrappers
(the ratio of a copy's rate to a new message's, round by round and its median), then
the last round's copies once more with each step wrapped: its share of a duplicate's
time in the consuming thread.

Steps are timed by wrapping the functions that do them (Python) and the driver's
``execute``/``commit`` (the database's share, by statement kind); what is left is
the Python around them (Django's ORM and atomic, signals, building the order).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

if "--shop" in sys.argv:
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings_shop"

from bench.common import payment, setup

N = int(os.environ.get("BENCH_PROFILE_MESSAGES", "400"))

#: Seconds and calls per (thread kind, step).
_spent: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
_consumer_thread = threading.get_ident()
_depth = threading.local()


def _kind() -> str:
    return "consumer" if threading.get_ident() == _consumer_thread else "publisher"


def _timed(step: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Only the outermost timed call counts: a step inside another is the other's.
        if getattr(_depth, "n", 0):
            return fn(*args, **kwargs)
        _depth.n = 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.n = 0
            slot = _spent[(_kind(), step)]
            slot[0] += time.perf_counter() - start
            slot[1] += 1

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


#: What each prepared statement of the session is (``WITH MOVED``, ``WITH QUEUED``), by name.
_prepared: dict[str, str] = {}


def _statement_kind(sql: Any, tables: dict[str, str]) -> str:
    text = sql.decode() if isinstance(sql, bytes) else str(sql)
    head = text.lstrip()[:16].upper()
    if head.startswith("BEGIN; "):  # the road's first text
        return "BEGIN + inbox claim + spent payment + order read (one text)"
    prepared = head.startswith(("EXECUTE", "PREPARE"))
    for name, body in re.findall(r"PREPARE (\S+) AS (WITH \w+)", text):
        _prepared[name] = body.upper()
    executed = re.match(r"\s*EXECUTE (\w+)", text)
    body = _prepared.get(executed[1], "") if executed else ""
    if head.startswith("WITH QUEUED") or body == "WITH QUEUED":
        # the save() road's last text: the follow-up's row with COMMIT, after save()
        return "outbox row + COMMIT (one text, after save())"
    if head.startswith("WITH MOVED") or (prepared and text.rstrip().endswith("; COMMIT")):
        # the road's second text (as it is, or its prepared statement's EXECUTE)
        commit = " + COMMIT" if text.rstrip().endswith("COMMIT") else ""
        return f"order UPDATE + outbox row{commit} (one text)"
    if head.startswith("WITH CLAIM") or head.startswith("EXECUTE"):
        return "one statement (WITH claim ...)"
    if head.startswith("WITH NEW_INBOX"):
        return "inbox claim + spent payment (one statement)"
    if head.startswith("SET LOCAL"):
        return "SET LOCAL synchronous_commit"
    for table, step in tables.items():
        if table in text[:400]:
            verb = head.split(" ", 1)[0]
            return f"{step}: {verb}"
    return "other SQL: " + head


def _patch(tables: dict[str, str]) -> None:
    import psycopg

    from idempotent_orders import dedup
    from idempotent_orders.consuming import batch, single
    from idempotent_orders.outbox import producer, sender

    execute = psycopg.Cursor.execute

    def timed_execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        kind = _statement_kind(query, tables)
        held = getattr(_depth, "n", 0)
        start = time.perf_counter()
        try:
            return execute(self, query, *args, **kwargs)
        finally:
            if not held:  # inside a timed Python step the step owns it
                slot = _spent[(_kind(), "SQL " + kind)]
                slot[0] += time.perf_counter() - start
                slot[1] += 1

    psycopg.Cursor.execute = timed_execute  # type: ignore[method-assign]
    from idempotent_orders import prepared

    # A prepared statement run with its arguments bound by the protocol (no cursor).
    if hasattr(prepared, "_send_prepared"):
        send_prepared = prepared._send_prepared

        def timed_send(raw: Any, name: bytes, params: Any) -> Any:
            start = time.perf_counter()
            try:
                return send_prepared(raw, name, params)
            finally:
                slot = _spent[(_kind(), "SQL one statement (WITH claim ...)")]
                slot[0] += time.perf_counter() - start
                slot[1] += 1

        prepared._send_prepared = timed_send
    commit = psycopg.Connection.commit

    def timed_commit(self: Any) -> None:
        start = time.perf_counter()
        try:
            commit(self)
        finally:
            slot = _spent[(_kind(), "SQL COMMIT")]
            slot[0] += time.perf_counter() - start
            slot[1] += 1

    psycopg.Connection.commit = timed_commit  # type: ignore[method-assign]
    # A ``with conn.transaction()`` block (the raw baseline): BEGIN on entry, COMMIT on exit.
    enter, leave = psycopg.Transaction.__enter__, psycopg.Transaction.__exit__

    def timed_enter(self: Any) -> Any:
        start = time.perf_counter()
        try:
            return enter(self)
        finally:
            slot = _spent[(_kind(), "SQL BEGIN")]
            slot[0] += time.perf_counter() - start
            slot[1] += 1

    def timed_exit(self: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return leave(self, *args)
        finally:
            slot = _spent[(_kind(), "SQL COMMIT")]
            slot[0] += time.perf_counter() - start
            slot[1] += 1

    psycopg.Transaction.__enter__ = timed_enter  # type: ignore[method-assign]
    psycopg.Transaction.__exit__ = timed_exit  # type: ignore[method-assign]
    single.parse_envelope = _timed("parse the envelope", single.parse_envelope)
    batch.parse_envelope = _timed("parse the envelope", batch.parse_envelope)
    dedup.lookup = _timed("fast path lookup (Bloom, Redis)", dedup.lookup)
    dedup.lookup_many = _timed("fast path lookup (Bloom, Redis)", dedup.lookup_many)
    dedup.remember = _timed("dedup remember (after commit)", dedup.remember)
    dedup.remember_many = _timed("dedup remember (after commit)", dedup.remember_many)
    import importlib

    # Wherever this version of the road calls them from (the modules moved over time).
    for name in ("single", "writing"):
        try:
            module = importlib.import_module(f"idempotent_orders.consuming.{name}")
        except ImportError:
            continue
        for attr, step in (
            ("call_transition", "the model's transition (fsm-2)"),
            ("decide", "decide"),
        ):
            if hasattr(module, attr):
                setattr(module, attr, _timed(step, getattr(module, attr)))
    producer._publish_after_commit = _timed(
        "after-commit hand-off to the publisher", producer._publish_after_commit
    )
    producer._publish_many_after_commit = _timed(
        "after-commit hand-off to the publisher", producer._publish_many_after_commit
    )
    sender._TemplateSender.send = _timed("broker publish", sender._TemplateSender.send)  # type: ignore[method-assign]
    sender._send = _timed("broker publish", sender._send)


def _trace(tmp: str) -> Callable[[], dict[str, int]]:
    """libpq's protocol trace on every new connection; returns a counter of round trips."""
    from django.db.backends.signals import connection_created

    files: list[tuple[str, str]] = []

    def traced(sender: Any, connection: Any, **kwargs: Any) -> None:
        raw = connection.connection
        path = os.path.join(tmp, f"trace-{len(files)}-{threading.get_ident()}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        raw.pgconn.trace(fd)
        files.append((_kind(), path))

    connection_created.connect(traced, weak=False)

    def count() -> dict[str, int]:
        totals: dict[str, int] = defaultdict(int)
        for kind, path in files:
            with open(path, encoding="utf-8", errors="replace") as trace:
                for line in trace:
                    parts = line.split("\t")
                    if len(parts) > 3 and parts[1] == "F" and parts[3].strip() in ("Query", "Sync"):
                        totals[kind] += 1
        return totals

    return count


def run(shop: bool, use_batch: bool, cprofile: bool) -> None:
    setup()
    from django.db import connections

    from idempotent_orders import get_order_model
    from idempotent_orders.consuming.batch import consume_batch
    from idempotent_orders.consuming.single import consume_message
    from idempotent_orders.models import OutboxMessage, ProcessedMessage, SpentPayment
    from idempotent_orders.outbox import flush_publisher

    model = get_order_model()
    tables = {
        ProcessedMessage._meta.db_table: "inbox claim",
        SpentPayment._meta.db_table: "spent payment",
        OutboxMessage._meta.db_table: "outbox",
        model._meta.db_table: "order",
    }
    connections.close_all()
    tmp = tempfile.mkdtemp(prefix="io-profile-")
    count_trips = _trace(tmp)
    from bench.common import make_orders

    # Patched before the warm-up, which prepares the session's statements (their names
    # tell the texts apart); what it spends is cleared below.
    _patch(tables)
    warm = [payment(o, "w-") for o in make_orders(50, model=model)]
    for message in warm:
        consume_message(message, consumer="payments")
    flush_publisher()
    orders = make_orders(N, model=model)
    messages = [payment(o, "p-") for o in orders]
    flush_publisher()
    before = count_trips()
    _spent.clear()
    profiler = None
    if cprofile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    if use_batch:
        for i in range(0, N, 200):
            consume_batch(messages[i : i + 200], consumer="payments")
    else:
        for message in messages:
            consume_message(message, consumer="payments")
    elapsed = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
    flush_publisher()
    from idempotent_orders import dedup

    dedup.flush()
    after = count_trips()
    # The raw psycopg transaction with the same writes, timed the same way (same run).
    from bench.consumer import _raw

    ours = dict(_spent)
    _spent.clear()
    raw_orders = make_orders(N, model=model)
    start = time.perf_counter()
    _raw(raw_orders, "raw-", follow_up=True)
    raw_elapsed = time.perf_counter() - start
    raw_trips = count_trips()
    raw_spent = dict(_spent)
    _spent.clear()
    _spent.update(ours)
    road = "consume_batch (200/batch)" if use_batch else "consume_message"
    print(f"\n{model.__name__}, {road}, {N} new messages, default configuration (PostgreSQL)")
    print(f"consuming thread: {elapsed / N * 1e3:.3f} ms per message (wall clock)\n")
    _print(elapsed, "consumer")
    publisher = sum(v[0] for (k, _), v in _spent.items() if k == "publisher")
    print(
        f"\npublisher thread (concurrent, shares the GIL and the 2 cores):"
        f" {publisher / N * 1e3:.3f} ms per message measured in its steps"
    )
    _print(elapsed, "publisher", total=False)
    for kind in ("consumer", "publisher"):
        trips = after.get(kind, 0) - before.get(kind, 0)
        print(f"round trips per message, {kind} thread: {trips / N:.2f}")
    print(
        f"\nraw psycopg transaction, same writes, same run: {raw_elapsed / N * 1e3:.3f} ms"
        f" per message ({elapsed / raw_elapsed:.2f}x ours: ratio ours/raw"
        f" {raw_elapsed / elapsed:.2f}); round trips per message"
        f" {(raw_trips.get('consumer', 0) - after.get('consumer', 0)) / N:.2f}"
    )
    _spent.clear()
    _spent.update(raw_spent)
    _print(raw_elapsed, "consumer", total=True)
    if profiler is not None:
        import pstats

        pstats.Stats(profiler).sort_stats(
            os.environ.get("BENCH_PSTATS_SORT", "tottime")
        ).print_stats(int(os.environ.get("BENCH_PSTATS_LINES", "25")))


def _print(elapsed: float, kind: str, total: bool = True) -> None:
    rows = sorted(
        ((step, v) for (k, step), v in _spent.items() if k == kind), key=lambda r: -r[1][0]
    )
    measured = sum(v[0] for _, v in rows)
    print(f"| step ({kind} thread) | ms/message | share | calls/message |")
    print("| --- | ---: | ---: | ---: |")
    for step, (seconds, calls) in rows:
        print(f"| {step} | {seconds / N * 1e3:.3f} | {seconds / elapsed:.0%} | {calls / N:.2f} |")
    if total:
        rest = elapsed - measured
        print(
            f"| Python around them (ORM, atomic, signals, building rows) | {rest / N * 1e3:.3f}"
            f" | {rest / elapsed:.0%} | |"
        )


#: The steps of a duplicate, by where they are done: ``(module, owner, attribute, step)``,
#: owner "" for a module function, else the attribute of the module holding the object.
#: A name this version of the road lacks is skipped (run the same file on older code).
DUPLICATE_STEPS = (
    ("idempotent_orders.consuming.single", "", "parse_envelope", "parse the envelope"),
    ("idempotent_orders.dedup", "memory", "contains", "this process's memory: lookup"),
    ("idempotent_orders.dedup", "bloom", "refresh", "Bloom filter: refresh"),
    ("idempotent_orders.dedup", "bloom", "might_contain", "Bloom filter: lookup"),
    ("idempotent_orders.dedup.redis", "RedisLayer", "flush", "Redis: this process's keys first"),
    ("idempotent_orders.dedup.redis", "RedisLayer", "_send", "Redis: GET, sent and its reply"),
    ("idempotent_orders.dedup.redis", "RedisLayer", "_post", "Redis: GET sent"),
    ("idempotent_orders.dedup.redis", "RedisLayer", "_reply", "Redis: GET's reply awaited, read"),
    ("idempotent_orders.dedup", "", "_announce", "dedup_answered: the layer counted"),
    ("idempotent_orders.consuming.single", "", "announce", "message_consumed: sent, counted"),
    # The batch road (--batch): each message parsed, one MGET for the chunk's "maybe"s.
    ("idempotent_orders.consuming.batch", "", "parse_envelope", "parse the envelope"),
    ("idempotent_orders.dedup.redis", "RedisLayer", "_get_many", "Redis: MGET round trip"),
    ("idempotent_orders.consuming.batch", "", "announce", "message_consumed: sent, counted"),
)


def _patch_duplicate_steps() -> None:
    import importlib

    for module_name, owner_name, attr, step in DUPLICATE_STEPS:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        if hasattr(owner, attr):
            setattr(owner, attr, _timed(step, getattr(owner, attr)))


def run_duplicates(cprofile: bool, use_batch: bool, elsewhere: bool = False) -> None:
    """``--duplicates``: duplicates against new messages, round by round, then the steps;
    with ``--batch`` both through ``consume_batch`` (``BENCH_BATCH_SIZE`` a call); with
    ``--elsewhere`` the copies arrive as at another process (this one's memory forgets
    them first), so Redis answers them."""
    import statistics

    from django.test import override_settings

    from bench.common import RUNS, make_orders
    from bench.consumer import default_configuration, differences, in_batches, one_by_one

    road = in_batches if use_batch else one_by_one
    from idempotent_orders import dedup, get_order_model, stats
    from idempotent_orders.outbox import flush_publisher

    config = default_configuration()
    with override_settings(IDEMPOTENT_ORDERS=config):
        model = get_order_model()
        one_by_one([payment(o, "w-") for o in make_orders(50, model=model)])
        dedup.bloom.wait_warm(60)  # a warming filter sends every copy to the database
        ratios: list[float] = []
        for run_no in range(RUNS):
            messages = [payment(o, f"d{run_no}-") for o in make_orders(N, model=model)]
            start = time.perf_counter()
            road(messages)
            new = time.perf_counter() - start
            flush_publisher()  # the follow-ups' publishing is not a duplicate's time
            dedup.flush()
            if elsewhere:
                dedup.memory.clear()
            before = stats.local()
            start, cpu = time.perf_counter(), time.thread_time()
            road(messages)
            dup, dup_cpu = time.perf_counter() - start, time.thread_time() - cpu
            ratios.append(new / dup)
            answered = {
                k: v - before.get(k, 0)
                for k, v in stats.local().items()
                if k.startswith("layer:") and v != before.get(k, 0)
            }
            print(
                f"round {run_no + 1}: new {new / N * 1e3:.3f} ms, duplicate"
                f" {dup / N * 1e6:.1f} us ({dup_cpu / N * 1e6:.1f} us of CPU) per message:"
                f" duplicates {new / dup:.1f}x new;"
                f" the copies answered by {answered}"
            )
        _patch_duplicate_steps()
        _spent.clear()
        profiler = None
        if cprofile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        if elsewhere:
            dedup.memory.clear()
        start = time.perf_counter()
        road(messages)
        elapsed = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        note = ", ".join(differences(config)) or "none"
    answered_by = (
        "at another process: Bloom 'maybe', Redis hit"
        if elsewhere
        else "at the process that applied them: its memory"
    )
    print(
        f"\n{model.__name__}, {road.__name__}, {N} duplicates"
        f" ({answered_by}),"
        f" default configuration (PostgreSQL); settings not at their defaults: {note}"
    )
    print(
        f"duplicates / new, {RUNS} rounds: {', '.join(f'{r:.1f}' for r in ratios)};"
        f" median {statistics.median(ratios):.1f}x"
    )
    print(f"with each step wrapped: {elapsed / N * 1e6:.1f} us per duplicate (wall clock)\n")
    rows = sorted(
        ((step, v) for (k, step), v in _spent.items() if k == "consumer"), key=lambda r: -r[1][0]
    )
    print("| step (consumer thread) | us/duplicate | share | calls/duplicate |")
    print("| --- | ---: | ---: | ---: |")
    for step, (seconds, calls) in rows:
        print(f"| {step} | {seconds / N * 1e6:.1f} | {seconds / elapsed:.0%} | {calls / N:.2f} |")
    rest = elapsed - sum(v[0] for _, v in rows)
    print(
        f"| Python around them (consume_message, the layers' settings, cache and key work)"
        f" | {rest / N * 1e6:.1f} | {rest / elapsed:.0%} | |"
    )
    if profiler is not None:
        import pstats

        pstats.Stats(profiler).sort_stats(
            os.environ.get("BENCH_PSTATS_SORT", "tottime")
        ).print_stats(int(os.environ.get("BENCH_PSTATS_LINES", "25")))


def main() -> None:
    setup()
    if "--duplicates" in sys.argv:
        run_duplicates("--cprofile" in sys.argv, "--batch" in sys.argv, "--elsewhere" in sys.argv)
        return
    from django.conf import settings
    from django.test import override_settings

    # The default configuration: the fulfilment follow-up on (the test settings turn it off).
    with override_settings(
        IDEMPOTENT_ORDERS={**settings.IDEMPOTENT_ORDERS, "FULFIL_AFTER_PAYMENT": True}
    ):
        if "--save" not in sys.argv:
            run("--shop" in sys.argv, "--batch" in sys.argv, "--cprofile" in sys.argv)
            return
        from django.db.models.signals import post_save

        from bench.consumer import _watched
        from idempotent_orders import get_order_model
        from idempotent_orders.consuming.running import road

        model = get_order_model()
        post_save.connect(_watched, sender=model, dispatch_uid="bench.profile.watched")
        assert road(model, "pay")[0] == "save"
        run("--shop" in sys.argv, "--batch" in sys.argv, "--cprofile" in sys.argv)


if __name__ == "__main__":
    main()
