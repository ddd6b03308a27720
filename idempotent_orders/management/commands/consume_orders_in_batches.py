"""``manage.py consume_orders_in_batches``: consume the consumer tasks' messages in batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser


class Command(BaseCommand):
    help = (
        "Consume consume_payment/consume_shipping task messages from a Celery queue in "
        "batches (consume_batch), acknowledging each batch after it committed."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--queue", required=True, help="The Celery queue to consume.")
        parser.add_argument("--batch-size", type=int, default=200)
        parser.add_argument(
            "--flush-interval",
            type=float,
            default=0.5,
            help="Seconds a partial batch waits for more messages before it is consumed.",
        )
        parser.add_argument(
            "--broker",
            default=None,
            help="Broker URL (default: the Celery app's broker_url).",
        )
        parser.add_argument(
            "--heartbeat-file",
            type=Path,
            default=None,
            metavar="PATH",
            help="Write the time to PATH on every turn of the loop (a liveness probe "
            "checks its age; the loop turns at least every --flush-interval).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from celery import current_app

        from idempotent_orders.contrib.batch_worker import BatchWorker

        if options["batch_size"] < 1 or options["flush_interval"] <= 0:
            raise CommandError("--batch-size must be >= 1 and --flush-interval > 0")
        app = current_app
        queue = app.amqp.queues[options["queue"]]  # declared as a Celery worker declares it
        with app.connection_for_read(options["broker"]) as conn:
            conn.ensure_connection(max_retries=10)
            worker = BatchWorker(
                conn,
                queue,
                batch_size=options["batch_size"],
                flush_interval=options["flush_interval"],
                heartbeat_file=options["heartbeat_file"],
            )
            worker.install_signal_handlers()
            self.stdout.write(
                f"consuming {options['queue']} in batches of {options['batch_size']} "
                f"(flush every {options['flush_interval']}s)"
            )
            worker.run()
        self.stdout.write(
            "stopped: {acked} acknowledged in {batches} batches, {requeued} requeued, "
            "{unrouted} dead-lettered".format(**worker.stats)
        )
