"""Sections 1 and 5: the consumer in one process against the raw limit, and the batch consumer.

The default configuration (every setting that bears on consuming at its default; the
ones left otherwise are printed) on the app's Order, and on the demo's ShopOrder
(transition bodies) in a child process (``python -m bench.consumer --shop``, its own
database: the order model is fixed when the settings load). Every operation is timed
one by one too: p50/p95/p99 latencies beside each rate, and the CPU a message. Two
baselines run in the same rounds: a raw psycopg transaction with the same writes, and
the project's own code by hand (the ORM, the model's transition and ``save()``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from bench.common import ROOT, RUNS, Row, fmt, make_orders, median, payment, setup

N = int(os.environ.get("BENCH_CONSUMER_MESSAGES", "400"))
BATCH = int(os.environ.get("BENCH_BATCH_SIZE", "200"))
#: Each run's copies go through this many times: one pass of N copies takes a few tens
#: of milliseconds, too short to time on a shared machine.
DUP_PASSES = int(os.environ.get("BENCH_DUPLICATE_PASSES", "5"))


def _raw(orders: list[Any], tag: str, follow_up: bool, times: list[float] | None = None) -> None:
    """psycopg by hand, one transaction each, with the writes ``consume_message`` makes: the
    inbox row, the spent payment, the conditional UPDATE (state, version, payment id,
    and on a model that has them what the demo's ``mark_paid`` body sets: the amount
    paid and when) and, with the fulfilment follow-up on (the default), its outbox row.
    """
    from django.db import connection

    from idempotent_orders import get_order_model
    from idempotent_orders.consuming import registry
    from idempotent_orders.consuming.graph import edge, state_field
    from idempotent_orders.models import OutboxMessage, ProcessedMessage, SpentPayment

    model = get_order_model()
    transition = registry.get_handler("payment.succeeded").transition  # type: ignore[union-attr]
    e = edge(model, transition)
    (source,) = e.sources
    names = {f.name for f in model._meta.concrete_fields}
    inbox, table = ProcessedMessage._meta.db_table, model._meta.db_table
    spent, outbox = SpentPayment._meta.db_table, OutboxMessage._meta.db_table
    state = state_field(model).column
    body = "".join(
        f", {column} = {value}"
        for column, value in (("amount_paid", "amount"), ("paid_at", "now()"))
        if column in names
    )
    raw = connection.connection  # the psycopg connection under Django's
    clock = time.perf_counter
    for order in orders:
        began = clock()
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
                f"UPDATE {table} SET {state} = %s, version = version + 1, payment_id = %s,"
                f" updated_at = now(){body} WHERE id = %s AND {state} IN (%s)"
                " AND version = %s",
                (e.target, f"p{order.pk}", order.pk, source, order.version),
            )
            if follow_up:
                cur.execute(
                    f"INSERT INTO {outbox} (message_id, task_name, payload, options, status,"
                    " attempts, last_error, order_key, traceparent, correlation_id)"
                    " VALUES (%s, 'idempotent_orders.fulfil_order', %s, '{}', 'pending', 0,"
                    " '', %s, '', '')",
                    (f"raw-fulfil-{tag}{order.pk}", str(order.pk), str(order.pk)),
                )
        if times is not None:
            times.append(clock() - began)


def _orm(orders: list[Any], tag: str, follow_up: bool, times: list[float] | None = None) -> None:
    """The project's own code without the app: in one ``atomic()`` per message, the inbox
    and spent-payment rows created through the ORM, the order read ``select_for_update``,
    its transition run (fsm-2) and ``save()``d, and the follow-up's outbox row created,
    as a shop writes it by hand. The user's Python (ORM, fsm-2, signals) on both sides."""
    import inspect

    from django.db import transaction

    from idempotent_orders import get_order_model
    from idempotent_orders.consuming import registry
    from idempotent_orders.models import OutboxMessage, ProcessedMessage, SpentPayment

    model = get_order_model()
    name = registry.get_handler("payment.succeeded").transition  # type: ignore[union-attr]
    takes = set(inspect.signature(getattr(model, name)).parameters)
    sets_payment = "payment_id" not in takes and any(
        f.name == "payment_id" for f in model._meta.concrete_fields
    )
    clock = time.perf_counter
    for order in orders:
        message = payment(order, f"orm-{tag}")
        began = clock()
        with transaction.atomic():
            ProcessedMessage.objects.create(
                consumer="orm",
                message_id=message["message_id"],
                message_type=message["type"],
                outcome="applied",
                order_id=order.pk,
                fingerprint="f" * 64,
            )
            SpentPayment.objects.create(
                payment_id=f"orm-{tag}{order.pk}",
                order_id=order.pk,
                consumer="orm",
                message_id=message["message_id"],
            )
            locked = model.objects.select_for_update().get(pk=order.pk)
            payload = message["payload"]
            getattr(locked, name)(**{k: v for k, v in payload.items() if k in takes})
            if sets_payment:
                locked.payment_id = payload["payment_id"]
            locked.save()
            if follow_up:
                OutboxMessage.objects.create(
                    message_id=f"orm-fulfil-{tag}{order.pk}",
                    task_name="idempotent_orders.fulfil_order",
                    payload=str(order.pk),
                    order_key=str(order.pk),
                )
        if times is not None:
            times.append(clock() - began)


def one_by_one(messages: list[dict[str, Any]], times: list[float] | None = None) -> None:
    """Each message through ``consume_message``, as a per-message consumer would."""
    from idempotent_orders.consuming.single import consume_message

    clock = time.perf_counter
    for message in messages:
        began = clock()
        consume_message(message, consumer="payments")
        if times is not None:
            times.append(clock() - began)


def elsewhere(messages: list[dict[str, Any]], times: list[float]) -> None:
    """The copies of ``messages`` as they arrive at a process that did not handle them:
    this process's memory forgets them before each pass, and Redis answers."""
    from idempotent_orders import dedup

    for _ in range(DUP_PASSES):
        dedup.memory.clear()
        one_by_one(messages, times)


def in_batches(messages: list[dict[str, Any]], times: list[float] | None = None) -> None:
    """The messages through ``consume_batch``, ``BATCH`` at a time (``times``: per batch)."""
    from idempotent_orders.consuming.batch import consume_batch

    clock = time.perf_counter
    for i in range(0, len(messages), BATCH):
        began = clock()
        consume_batch(messages[i : i + BATCH], consumer="payments")
        if times is not None:
            times.append(clock() - began)


def _pass() -> None:
    pass


def _rate(n: int, fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return n / (time.perf_counter() - start)


def percentiles(times: list[float]) -> str:
    """``p50/p95/p99`` of ``times`` (seconds) in milliseconds."""
    if len(times) < 2:
        return "p50/p95/p99 n/a"
    cuts = statistics.quantiles(times, n=100, method="inclusive")
    p50, p95, p99 = (cuts[i] * 1e3 for i in (49, 94, 98))
    return f"p50/p95/p99 {p50:.2f}/{p95:.2f}/{p99:.2f} ms"


Measured = dict[str, Any]

#: In every message id: a new benchmark database restarts the order ids, and the fast
#: path's Redis keys of an earlier run must not answer this run's messages.
RUN_TAG = uuid.uuid4().hex[:8]


#: What the ``held`` series changes: the follow-up's outbox row is written in the message's
#: transaction and left pending for a relay elsewhere, as the raw transaction leaves it,
#: instead of being published by this process's publisher thread after commit.
HELD = {"OUTBOX_PUBLISH_ON_COMMIT": False}


def _measure(tag: str, follow_up: bool, held: bool = False) -> Measured:
    """Median rates (and pooled latencies) of the raw transaction, new messages,
    duplicates and batches, interleaved run by run; with ``held``, new messages under
    :data:`HELD` too (a NON-DEFAULT series: the same writes as the raw transaction)."""
    from django.conf import settings
    from django.test import override_settings

    from idempotent_orders import get_order_model
    from idempotent_orders.outbox import flush_publisher

    model = get_order_model()
    tag = f"{RUN_TAG}{tag}"
    kinds = ("raw", "orm", "new", "dup", "elsewhere", "batch", *(("held",) if held else ()))
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    times: dict[str, list[float]] = {k: [] for k in rates}
    #: CPU seconds a message of each series: this thread's, and the whole process's
    #: until ``settle`` (the publisher's backlog) is done too.
    cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in rates}

    def timed(kind: str, n: int, fn: Callable[[], Any], settle: Callable[[], Any] = _pass) -> None:
        thread, process = time.thread_time(), time.process_time()
        rates[kind].append(_rate(n, fn))
        thread = time.thread_time() - thread
        settle()
        cpu[kind].append((thread / n, (time.process_time() - process) / n))

    for run_no in range(RUNS):
        orders = make_orders(N, model=model)
        timed("raw", N, lambda o=orders, t=f"{tag}r{run_no}-": _raw(o, t, follow_up, times["raw"]))
        orders = make_orders(N, model=model)
        timed("orm", N, lambda o=orders, t=f"{tag}o{run_no}-": _orm(o, t, follow_up, times["orm"]))
        orders = make_orders(N, model=model)
        messages = [payment(o, f"{tag}s{run_no}-") for o in orders]
        # The publisher thread's backlog (the new messages' follow-ups, up to its linger)
        # is published before the duplicates are timed, not during them.
        timed("new", N, lambda m=messages: one_by_one(m, times["new"]), flush_publisher)
        timed(
            "dup",
            N * DUP_PASSES,
            lambda m=messages: [one_by_one(m, times["dup"]) for _ in range(DUP_PASSES)],
        )
        timed("elsewhere", N * DUP_PASSES, lambda m=messages: elsewhere(m, times["elsewhere"]))
        if held:
            messages = [payment(o, f"{tag}h{run_no}-") for o in make_orders(N, model=model)]
            with override_settings(IDEMPOTENT_ORDERS={**settings.IDEMPOTENT_ORDERS, **HELD}):
                timed("held", N, lambda m=messages: one_by_one(m, times["held"]), flush_publisher)
        orders = make_orders(N, model=model)
        messages = [payment(o, f"{tag}b{run_no}-") for o in orders]
        # This run's follow-ups are not published during the next.
        timed("batch", N, lambda m=messages: in_batches(m, times["batch"]), flush_publisher)
    return {
        k: {
            "rate": median(v),
            "latency": percentiles(times[k]),
            "cpu": [median([c[i] for c in cpu[k]]) for i in (0, 1)],
        }
        for k, v in rates.items()
    }


#: Settings the default-configuration rows keep as the bench settings have them (where
#: this machine's Redis is, and what only HTTP or the fulfilment worker reads).
ENVIRONMENT = ("DEDUP_CACHE_ALIAS", "FULFILMENT_CLIENT", "KEY_QUOTA", "TOKEN_QUOTA")


def default_configuration() -> dict[str, Any]:
    """The bench's ``IDEMPOTENT_ORDERS`` with every other setting back at its default."""
    from django.conf import settings

    from idempotent_orders.conf import DEFAULTS

    kept = {k: v for k, v in settings.IDEMPOTENT_ORDERS.items() if k in ENVIRONMENT}
    if "FULFILMENT_TRANSITION" in settings.IDEMPOTENT_ORDERS:  # a swapped model names its own
        kept["FULFILMENT_TRANSITION"] = settings.IDEMPOTENT_ORDERS["FULFILMENT_TRANSITION"]
    return {k: v for k, v in kept.items() if DEFAULTS.get(k, object()) != v}


def differences(config: dict[str, Any]) -> list[str]:
    """``NAME=value`` of each setting in ``config`` (and DEBUG, the order model) that is
    not the default."""
    from django.conf import settings

    from idempotent_orders.conf import DEFAULTS, order_model_label

    found = [f"{k}={v!r}" for k, v in sorted(config.items()) if DEFAULTS.get(k, object()) != v]
    if settings.DEBUG:
        found.append("DEBUG=True")
    if order_model_label() != "idempotent_orders.Order":
        found.append(f"IDEMPOTENT_ORDERS_ORDER_MODEL={order_model_label()!r}")
    return found


def _child() -> None:
    """``--shop``: the default configuration on the demo's ShopOrder; prints JSON."""
    setup()
    from django.test import override_settings

    config = default_configuration()
    with override_settings(IDEMPOTENT_ORDERS=config):
        got = _measure("shop", follow_up=True, held=True)
        got["settings"] = differences(config)
        got["saved"] = _save_road("shopv")
    print(json.dumps(got))


def _shop() -> Measured | str:
    """The ShopOrder measurement from a child process, or why it failed."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "bench.settings_shop"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.consumer", "--shop"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode:
        return (done.stderr.strip().splitlines() or ["no output"])[-1][:100]
    got: Measured = json.loads(done.stdout.strip().splitlines()[-1])
    return got


def held_label() -> str:
    """How a row of the ``held`` series is labelled (sections 1 and 1b)."""
    changed = ", ".join(f"{k}={v!r}" for k, v in HELD.items())
    return f"NON-DEFAULT ({changed}: the follow-up's row left to a relay, as raw leaves it)"


def cpu_note(got: Measured, kind: str) -> str:
    """CPU a message of ``got[kind]``: the consuming thread's, and the whole process's (its
    publisher and dedup threads too). Machine-bound like every time, but without the round
    trips' waits that the ratios to the raw transaction move with."""
    if "cpu" not in got[kind]:
        return "CPU n/a"
    thread, process = got[kind]["cpu"]
    unit, scale = ("us", 1e6) if process < 1e-4 else ("ms", 1e3)
    digits = 1 if unit == "us" else 3
    return (
        f"CPU/msg {thread * scale:.{digits}f} {unit} thread, {process * scale:.{digits}f} process"
    )


def _held_row(section: str, label: str, got: Measured) -> Row:
    """The NON-DEFAULT ``held`` series beside the same run's raw transaction."""
    raw, held = got["raw"]["rate"], got["held"]["rate"]
    return Row(
        section,
        f"{label}, {held_label()}: consume_message, new",
        fmt(held),
        f"{held / raw:.2f}x raw, the same writes; {got['held']['latency']};"
        f" {cpu_note(got, 'held')}",
        figure=held,
        baseline=raw,
        baseline_what="raw psycopg txn, the same writes",
    )


def _rows(section: str, label: str, got: Measured, same: str) -> list[Row]:
    raw, orm, new, dup, elsewhere, batch = (
        got[k]["rate"] for k in ("raw", "orm", "new", "dup", "elsewhere", "batch")
    )
    return [
        Row(
            section,
            f"{label}: raw psycopg txn: {same}",
            fmt(raw),
            f"{got['raw']['latency']}; {cpu_note(got, 'raw')}",
        ),
        Row(
            section,
            f"{label}: the project's code by hand (ORM, transition, save(); no app)",
            fmt(orm),
            f"{orm / raw:.2f}x raw; {got['orm']['latency']}; {cpu_note(got, 'orm')}",
            figure=orm,
            baseline=raw,
            baseline_what="raw psycopg txn, the same writes",
        ),
        Row(
            section,
            f"{label}: consume_message, new",
            fmt(new),
            f"{new / raw:.2f}x raw (target >= 1.0), {new / orm:.2f}x by hand;"
            f" {got['new']['latency']}; {cpu_note(got, 'new')}",
            figure=new,
            baseline=raw,
            baseline_what="raw psycopg txn, the same writes",
        ),
        Row(
            section,
            f"{label}: consume_message, duplicates (the process that handled them)",
            fmt(dup),
            f"{dup / new:.1f}x new (target >= 20); {got['dup']['latency']}",
            figure=dup,
            baseline=new,
            baseline_what="consume_message, new",
        ),
        Row(
            section,
            f"{label}: consume_message, duplicates at another process (Redis answers)",
            fmt(elsewhere),
            f"{elsewhere / new:.1f}x new; {got['elsewhere']['latency']};"
            f" {cpu_note(got, 'elsewhere')}",
            figure=elsewhere,
            baseline=new,
            baseline_what="consume_message, new",
        ),
        Row(
            section.replace("1 consumer", "5 batch"),
            f"{label}: consume_batch, new, {BATCH}/batch",
            fmt(batch),
            f"{batch / raw:.1f}x raw (target >= 5); {batch / new:.1f}x consume_message;"
            f" per batch {got['batch']['latency']}",
            figure=batch,
            baseline=raw,
            baseline_what="raw psycopg txn, the same writes",
        ),
    ]


def _watched(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
    """A project's ``post_save`` receiver that does nothing: what makes the save() road."""


def _save_road(tag: str) -> Measured:
    """The default configuration on the same order model with a ``post_save`` receiver
    connected: every transition committed by the model's ``save()``."""
    from django.db.models.signals import post_save

    from idempotent_orders import get_order_model
    from idempotent_orders.consuming.registry import get_handler
    from idempotent_orders.consuming.running import road

    model = get_order_model()
    post_save.connect(_watched, sender=model, dispatch_uid="bench.consumer.watched")
    try:
        handler = get_handler("payment.succeeded")
        assert handler is not None
        assert road(model, handler.transition)[0] == "save"
        return _measure(tag, follow_up=True)
    finally:
        post_save.disconnect(sender=model, dispatch_uid="bench.consumer.watched")


def _save_rows(section: str, got: Measured, model: str = "Order", body: float = 0.0) -> list[Row]:
    """The save() road's rows; ``body``: the same model's rate without the receiver."""
    raw, orm, new, batch = (got[k]["rate"] for k in ("raw", "orm", "new", "batch"))
    label = f"{model} + a post_save receiver (the save() road)"
    beside = f"{new / body:.2f}x the same model without it; " if body else ""
    return [
        Row(
            section,
            f"{label}: consume_message, new",
            fmt(new),
            f"{new / raw:.2f}x raw in its run, {new / orm:.2f}x by hand (the receiver too);"
            f" {beside}{got['new']['latency']}; {cpu_note(got, 'new')}",
            figure=new,
            baseline=raw,
            baseline_what="raw psycopg txn, the same writes",
        ),
        Row(
            section.replace("1 consumer", "5 batch"),
            f"{label}: consume_batch, new, {BATCH}/batch (one save() a transition)",
            fmt(batch),
            f"{batch / raw:.1f}x raw in its run; per batch {got['batch']['latency']}",
            figure=batch,
            baseline=raw,
            baseline_what="raw psycopg txn, the same writes",
        ),
    ]


def run() -> list[Row]:
    setup()
    from django.db import connection
    from django.test import override_settings

    from idempotent_orders import dedup

    connection.ensure_connection()
    config = default_configuration()
    # The default configuration first; then the tuned road (the follow-up off), labelled.
    with override_settings(IDEMPOTENT_ORDERS=config):
        default = _measure("d", follow_up=True, held=True)
        settings_note = differences(config)
        saved = _save_road("v")
    tuned_config = {**config, "FULFIL_AFTER_PAYMENT": False}
    with override_settings(IDEMPOTENT_ORDERS=tuned_config):
        tuned = _measure("t", follow_up=False)
        tuned_note = differences(tuned_config)
    shop = _shop()
    fast = "fast path wired" if _fast_path_active(dedup) else "fast path NOT wired"
    same = "inbox + spent payment + UPDATE + follow-up outbox row"
    section = "1 consumer (PG, 1 proc)"
    rows = [
        Row(
            section, "Order: settings not at their defaults", "", ", ".join(settings_note) or "none"
        ),
        *_rows(section, "Order", default, same),
    ]
    (dup_row,) = [r for r in rows if "(the process that handled them)" in r.what]
    dup_row.note += f"; {fast}"
    if isinstance(shop, str):
        rows.append(Row(section, "ShopOrder (demo, transition bodies)", "n/a", shop))
    else:
        rows.append(
            Row(
                section,
                "ShopOrder (demo, transition bodies): settings not at their defaults",
                "",
                ", ".join(shop["settings"]) or "none",
            )
        )
        rows += _rows(section, "ShopOrder (demo, transition bodies)", shop, same)
    rows += _save_rows(section, saved)
    if not isinstance(shop, str):
        rows += _save_rows(section, shop["saved"], "ShopOrder", body=shop["new"]["rate"])
    rows.append(_held_row(section, "Order", default))
    if not isinstance(shop, str) and "held" in shop:
        rows.append(_held_row(section, "ShopOrder", shop))
    raw_t, new_t, batch_t = (tuned[k]["rate"] for k in ("raw", "new", "batch"))
    changed = sorted(set(tuned_note) - set(settings_note))
    label = f"Order, NON-DEFAULT ({', '.join(changed)})"
    rows += [
        Row(
            section,
            f"{label}: consume_message, new",
            fmt(new_t),
            f"{new_t / raw_t:.2f}x its raw txn without the outbox row ({fmt(raw_t)});"
            f" {tuned['new']['latency']}",
            figure=new_t,
            baseline=raw_t,
            baseline_what="raw psycopg txn without the follow-up",
        ),
        Row(
            "5 batch (PG, 1 proc)",
            f"{label}: consume_batch, new",
            fmt(batch_t),
            f"{batch_t / raw_t:.1f}x its raw txn; per batch {tuned['batch']['latency']}",
            figure=batch_t,
            baseline=raw_t,
            baseline_what="raw psycopg txn without the follow-up",
        ),
    ]
    return rows


def _fast_path_active(dedup: Any) -> bool:
    # The no-op placeholder module has only seen() and remember().
    return any(
        not name.startswith("_") and name not in {"seen", "remember", "annotations"}
        for name in vars(dedup)
    )


if __name__ == "__main__":
    if "--shop" in sys.argv:
        _child()
    else:
        from bench.common import print_table

        print_table(run())
