"""``manage.py purge_idempotent_orders``: delete rows older than their retention windows."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from idempotent_orders.retention import purge


class Command(BaseCommand):
    help = (
        "Delete old inbox rows, give up old parked messages, delete expired keys, old "
        "webhook events and fired timers, in batches."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=int, default=None)

    def handle(self, *args: Any, batch_size: int | None, **options: Any) -> None:
        report = purge(batch_size=batch_size)
        self.stdout.write(", ".join(f"{k}={v}" for k, v in report.as_dict().items()))
