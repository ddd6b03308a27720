"""``manage.py surface_parked``: release what can go ahead, mark overdue parked messages."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from idempotent_orders.consuming.single import surface_overdue_parked


class Command(BaseCommand):
    help = (
        "Release parked messages that can go ahead, then mark those that waited longer "
        "than PARKED_TIMEOUT as overdue (sends parked_overdue); run it from cron or use "
        "the Celery task."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--timeout", type=int, help="seconds; default PARKED_TIMEOUT")

    def handle(self, *args: Any, **options: Any) -> None:
        marked = surface_overdue_parked(timeout=options["timeout"])
        for parked in marked:
            self.stdout.write(
                f"overdue: {parked.consumer}:{parked.message_id} order {parked.order_id} "
                f"seq {parked.seq}: {parked.reason}"
            )
        self.stdout.write(f"{len(marked)} parked message(s) newly marked overdue")
