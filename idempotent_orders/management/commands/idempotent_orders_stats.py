"""``manage.py idempotent_orders_stats``: consume outcomes, dedup layers, outbox and dead rows."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from idempotent_orders import stats
from idempotent_orders.idempotent import inbox_stats
from idempotent_orders.outbox import outbox_stats


class Command(BaseCommand):
    help = (
        "Show how many messages ended in each outcome and which dedup layer answered, "
        "the outbox's pending, sent, dead and retried rows and the inbox's dead and failing "
        "@idempotent rows (read from the database)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print one JSON object")
        parser.add_argument("--reset", action="store_true", help="zero the shared counters")

    def handle(self, *args: Any, **options: Any) -> None:
        stats.flush()
        counts = stats.read()
        if options["reset"]:
            stats.reset(shared=True)
        outbox = outbox_stats()
        for name in ("pending", "sent", "dead", "retried"):
            counts[f"outbox:{name}"] = outbox[name]
        for name, count in inbox_stats().items():
            counts[f"inbox:{name}"] = count
        if options["json"]:
            self.stdout.write(json.dumps(counts, sort_keys=True))
            return
        width = max(len(name) for name in counts)
        for name in sorted(counts):
            self.stdout.write(f"{name:<{width}}  {counts[name]:>12}")
