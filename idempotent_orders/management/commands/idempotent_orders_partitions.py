"""``manage.py idempotent_orders_partitions convert|maintain|status|revert``: inbox partitions."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from idempotent_orders.partitioning import convert, is_partitioned, partitions, revert
from idempotent_orders.retention import maintain_partitions


class Command(BaseCommand):
    help = (
        "PostgreSQL: convert the inbox to a table partitioned by created_at (offline), keep "
        "partitions ready ahead and drop those past DEDUP_RETENTION (maintain), list them "
        "(status), or rebuild the one plain table (revert)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["convert", "maintain", "status", "revert"])
        parser.add_argument("--database", default="default")

    def handle(self, *args: Any, action: str, database: str, **options: Any) -> None:
        try:
            if action == "convert":
                convert(using=database)
            elif action == "revert":
                revert(using=database)
            elif action == "maintain":
                if not is_partitioned(database):
                    raise CommandError("the inbox is not partitioned: run convert first")
                report = maintain_partitions(using=database)
                self.stdout.write(
                    f"created={len(report.created)} dropped={len(report.dropped)}"
                    f" dropped_rows~{report.dropped_rows} kept_rows={report.kept_rows}"
                )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if not is_partitioned(database):
            self.stdout.write("the inbox is one plain table")
            return
        for partition in partitions(database):
            span = (
                "default (kept rows)"
                if partition.start is None
                else f"{partition.start:%Y-%m-%d %H:%M} .. {partition.end:%Y-%m-%d %H:%M}"
            )
            self.stdout.write(f"{partition.name}: {span}")
