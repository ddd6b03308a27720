"""``manage.py purge_outbox``: delete sent outbox rows past their retention."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from idempotent_orders.outbox import outbox_stats, purge_outbox


class Command(BaseCommand):
    help = "Delete sent outbox rows older than OUTBOX_RETENTION (or --older-than seconds)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than", type=int, default=None, metavar="SECONDS")

    def handle(self, *args: Any, **options: Any) -> None:
        deleted = purge_outbox(older_than=options["older_than"])
        stats = outbox_stats()
        self.stdout.write(
            f"deleted={deleted} pending={stats['pending']} sent={stats['sent']} "
            f"dead={stats['dead']} retried={stats['retried']}"
        )
