"""``manage.py requeue_outbox``: put dead-lettered outbox rows back in the relay's queue."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from idempotent_orders.outbox import requeue_outbox


class Command(BaseCommand):
    help = (
        "Requeue dead outbox rows (status dead -> pending, attempts reset, due now). "
        "Name them with --message-id and/or --task, or pass --all."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--message-id",
            action="append",
            dest="message_ids",
            metavar="ID",
            help="a dead row's message id (repeatable)",
        )
        parser.add_argument("--task", dest="task_name", help="only rows of this task name")
        parser.add_argument("--all", action="store_true", help="every dead row")
        parser.add_argument("--dry-run", action="store_true", help="count the rows, change nothing")

    def handle(self, *args: Any, **options: Any) -> None:
        message_ids, task_name = options["message_ids"], options["task_name"]
        if not (message_ids or task_name or options["all"]):
            raise CommandError("name the rows: --message-id ID, --task NAME or --all")
        count = requeue_outbox(
            message_ids=message_ids, task_name=task_name, dry_run=options["dry_run"]
        )
        self.stdout.write(f"{'would requeue' if options['dry_run'] else 'requeued'}={count}")
