"""``manage.py reconcile_orders``: one reconciler pass over expired leases."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from idempotent_orders.reconcile import reconcile


class Command(BaseCommand):
    help = "Complete, retry or fail leased work whose lease expired (verifying first)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--limit", type=int, default=None, help="rows per pass")
        parser.add_argument(
            "--until-empty", action="store_true", help="repeat passes until nothing is left"
        )

    def handle(self, *args: Any, limit: int | None, until_empty: bool, **options: Any) -> None:
        while True:
            report = reconcile(limit=limit)
            self.stdout.write(str(report))
            if not until_empty or not report.actions:
                return
