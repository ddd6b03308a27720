"""``manage.py relay_outbox``: publish pending outbox rows once, or keep relaying."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from idempotent_orders.outbox import relay_outbox


class Command(BaseCommand):
    help = "Publish pending outbox rows (task_id = message_id) and mark them sent."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=int, default=None)
        parser.add_argument("--loop", action="store_true", help="Keep relaying until interrupted.")
        parser.add_argument(
            "--interval", type=float, default=1.0, help="Seconds between runs with --loop."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        while True:
            result = relay_outbox(batch_size=options["batch_size"])
            self.stdout.write(
                f"published={result.published} retried={result.retried} "
                f"pending={result.pending} dead={result.dead}"
            )
            if not options["loop"]:
                return
            time.sleep(options["interval"])
