"""Shared helpers: a fresh benchmark database, orders in bulk, medians and table rows."""

from __future__ import annotations

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


@dataclass
class Row:
    section: str
    what: str
    value: str
    note: str = ""


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
    setup.done = True  # type: ignore[attr-defined]


def make_orders(n: int, amount: str = "12.50") -> list[Any]:
    from idempotent_orders.models import Order

    tag = uuid.uuid4().hex[:8]
    return Order.objects.bulk_create(
        Order(business_key=f"bench-{tag}-{i}", amount=Decimal(amount), currency="CNY")
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
