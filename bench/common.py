"""Shared helpers: a fresh benchmark database, orders in bulk, medians and table rows."""

from __future__ import annotations

import atexit
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: How many times each measurement is repeated; the table shows the median.
RUNS = int(os.environ.get("BENCH_RUNS", "3"))
#: The lease of django-reliable-outbox's workers in the crash run (its default, 60 s,
#: is noted in the table): set by bench.outbox_reliable, reported by bench.outbox.
CRASH_LEASE_S = 5.0


@dataclass
class Row:
    section: str
    what: str
    value: str
    note: str = ""
    #: The measured figure as a number (a rate), for the results file and the chart.
    figure: float | None = None
    #: The baseline measured in the same run that ``figure`` is compared with, and its name.
    baseline: float | None = None
    baseline_what: str = ""


def setup(fresh: bool = True) -> None:
    """Point Django at the benchmark database (dropped and migrated when ``fresh``)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import django
    from django.conf import settings

    if settings.configured and getattr(setup, "done", False):
        return
    django.setup()
    db = settings.DATABASES["default"]
    if fresh and db["ENGINE"].endswith("postgresql"):
        import psycopg

        admin = psycopg.connect(
            host=db["HOST"] or None,
            port=db["PORT"] or None,
            user=db["USER"] or None,
            password=db["PASSWORD"] or None,
            dbname="postgres",
            autocommit=True,
        )
        with admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db["NAME"]}"')
            admin.execute(f'CREATE DATABASE "{db["NAME"]}"')
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    if fresh:
        # The run's fast-path keys live a day: left in a shared Redis, they would slow
        # every later SCAN of it (the test suite's per-test cleanup walks the whole
        # database). Those of an earlier run go now, this run's when it ends.
        forget_redis_keys()
        atexit.register(forget_redis_keys)
    setup.done = True  # type: ignore[attr-defined]


def forget_redis_keys() -> int:
    """Delete the keys under the benchmark's own cache prefixes; how many went."""
    from django.core.cache import caches

    deleted = 0
    for alias in caches:
        delete_pattern = getattr(caches[alias], "delete_pattern", None)
        if delete_pattern is None:
            continue
        try:
            deleted += delete_pattern("*", itersize=10_000) or 0
        except Exception as exc:  # Redis away: nothing of ours is kept there either
            print(f"[bench] Redis keys of cache {alias!r} not deleted: {exc!r}", file=sys.stderr)
    return deleted


def round_trips() -> dict[str, tuple[float, float]]:
    """The p50 of one round trip, in microseconds, to PostgreSQL (``SELECT 1`` on Django's
    connection) and to Redis (a ``GET`` through the dedup cache's client): ``(from idle,
    sustained)``. From idle: the first 100 trips after a pause; sustained: 400 trips after
    half a second of back-to-back trips. A machine whose round trips slow down under
    sustained load (seen on these shared VMs: 17-27 us from idle, 77-115 us sustained)
    gives every figure above a share of that, the raw transaction's six trips most."""
    from django.core.cache import caches
    from django.db import connection

    from idempotent_orders.conf import conf

    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")

        def sql() -> None:
            cursor.execute("SELECT 1")
            cursor.fetchone()

        found = {"postgresql": _regimes(sql)}
    if conf.DEDUP_CACHE_ALIAS:
        client = caches[conf.DEDUP_CACHE_ALIAS].client.get_client()  # type: ignore[attr-defined]
        found["redis"] = _regimes(lambda: client.get("bench:round-trip"))
    return found


def _regimes(trip: Callable[[], Any]) -> tuple[float, float]:
    def p50(n: int) -> float:
        times = []
        for _ in range(n):
            began = time.perf_counter()
            trip()
            times.append(time.perf_counter() - began)
        return statistics.median(times) * 1e6

    time.sleep(0.5)
    idle = p50(100)
    until = time.monotonic() + 0.5
    while time.monotonic() < until:
        trip()
    return idle, p50(400)


def make_orders(n: int, amount: str = "12.50", model: Any = None) -> list[Any]:
    """``n`` new orders of ``model`` (the app's Order unless given)."""
    from idempotent_orders.models import Order

    model = Order if model is None else model
    tag = uuid.uuid4().hex[:8]
    return model._default_manager.bulk_create(
        model(business_key=f"bench-{tag}-{i}", amount=Decimal(amount), currency="CNY")
        for i in range(n)
    )


def payment(order: Any, tag: str = "") -> dict[str, Any]:
    return {
        "message_id": f"pay-{tag}{order.pk}",
        "type": "payment.succeeded",
        "order_id": order.pk,
        "payload": {"payment_id": f"p{order.pk}", "amount": str(order.amount), "currency": "CNY"},
    }


def rate(n: int, fn: Callable[[], Any]) -> float:
    """Items per second of one call of ``fn`` that handles ``n`` items."""
    start = time.perf_counter()
    fn()
    return n / (time.perf_counter() - start)


def median(values: list[float]) -> float:
    return statistics.median(values)


def fmt(value: float, unit: str = "/s") -> str:
    return f"{value:,.0f}{unit}" if value >= 100 else f"{value:,.1f}{unit}"


def na(section: str, what: str, reason: str) -> Row:
    return Row(section, what, "n/a", reason)


def print_table(rows: list[Row]) -> None:
    widths = [
        max(len(getattr(r, f)) for r in [Row("section", "what", "value", "note"), *rows])
        for f in ("section", "what", "value")
    ]
    head = Row("section", "what", "value", "note")
    for r in [head, Row(*("-" * w for w in widths), "----"), *rows]:
        print(
            f"| {r.section:<{widths[0]}} | {r.what:<{widths[1]}} | {r.value:>{widths[2]}} | {r.note} |"
        )
    sys.stdout.flush()


#: Where each run's figures are appended (git-ignored), one JSON object per run.
RESULTS = ROOT / "build" / "bench" / "results.jsonl"
#: The chart ``python -m bench --chart`` writes (each figure beside its baseline).
CHART = ROOT / "docs" / "img" / "benchmarks.png"


def record(rows: list[Row], meta: dict[str, Any], path: Path = RESULTS) -> Path:
    """Append this run's rows (with their numeric figures and baselines) to ``path``."""
    import json
    from dataclasses import asdict

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps({**meta, "rows": [asdict(r) for r in rows]}) + "\n")
    return path


def chart(rows: list[Row], title: str, path: Path = CHART) -> Path | None:
    """A PNG with one panel per compared figure: the figure beside its baseline."""
    pairs = [r for r in rows if r.figure is not None and r.baseline is not None]
    if not pairs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    lines = -(-len(pairs) // cols)
    fig, axes = plt.subplots(lines, cols, figsize=(4.2 * cols, 2.5 * lines), squeeze=False)
    for ax, r in zip(axes.flat, pairs, strict=False):
        assert r.figure is not None
        assert r.baseline is not None
        labels = [_wrap(r.baseline_what), _wrap(r.what)]
        bars = ax.barh(labels, [r.baseline, r.figure], color=["#9e9e9e", "#1565c0"])
        ax.bar_label(bars, labels=[fmt(r.baseline), fmt(r.figure)], padding=3, fontsize=8)
        ax.set_title(f"{r.section}: {r.figure / r.baseline:.2f}x", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlim(0, max(r.baseline, r.figure) * 1.35)
    for ax in list(axes.flat)[len(pairs) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _wrap(text: str, width: int = 26) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or text


def kill_at_marker(relay: Any, marker: Path, what: str, timeout: float = 120) -> float:
    """SIGKILL the process group of ``relay`` once it wrote ``marker``; the kill's moment.

    The crash sections' relays write the marker when they stall after the
    publishes they were told to make.
    """
    import signal

    deadline = time.monotonic() + timeout
    while not marker.exists() and relay.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.exists(), f"{what} did not reach its publishes"
    os.killpg(relay.pid, signal.SIGKILL)
    killed = time.monotonic()
    relay.wait(30)
    return killed
