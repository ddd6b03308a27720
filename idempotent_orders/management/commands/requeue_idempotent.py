"""``manage.py requeue_idempotent``: dead ``@idempotent`` messages run on their next delivery."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from idempotent_orders.idempotent import requeue_inbox


class Command(BaseCommand):
    help = (
        "Requeue dead @idempotent inbox rows (status dead -> processing, attempts reset): "
        "the next delivery of each message runs the work again. Name them with "
        "--consumer C --message-id M, or pass --all-dead (with --consumer: that consumer's)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--consumer", help="the inbox consumer the rows belong to")
        parser.add_argument(
            "--message-id",
            action="append",
            dest="message_ids",
            metavar="ID",
            help="a dead row's message id (repeatable; needs --consumer)",
        )
        parser.add_argument("--all-dead", action="store_true", help="every dead row")
        parser.add_argument("--dry-run", action="store_true", help="count the rows, change nothing")

    def handle(self, *args: Any, **options: Any) -> None:
        consumer, message_ids = options["consumer"], options["message_ids"]
        if not (message_ids or options["all_dead"]):
            raise CommandError("name the rows: --consumer C --message-id ID, or --all-dead")
        if message_ids and not consumer:
            raise CommandError(
                "--message-id needs --consumer (message ids are unique per consumer)"
            )
        count = requeue_inbox(
            consumer=consumer, message_ids=message_ids, dry_run=options["dry_run"]
        )
        self.stdout.write(f"{'would requeue' if options['dry_run'] else 'requeued'}={count}")
