"""The demo: orders paid and shipped through real Celery workers under duplicates and reordering."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

from celery import current_app
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Count, Q
from kombu import Exchange, Queue

from demo_project.models import LoyaltyAccount
from demo_project.shop import POINTS_PER_UNIT, place_order, points_message_id
from idempotent_orders import get_order_model
from idempotent_orders.conf import conf
from idempotent_orders.consuming.graph import edge, state_field
from idempotent_orders.consuming.registry import get_handler
from idempotent_orders.models import (
    AbstractOrder,
    OutboxMessage,
    OutboxStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.outbox import relay_outbox
from idempotent_orders.tasks import publish


def final_state() -> str:
    """The state a delivered order ends in, read from the order model's own graph."""
    handler = get_handler("shipment.delivered")
    if handler is None:
        raise CommandError("no handler is registered for shipment.delivered")
    return edge(get_order_model(), handler.transition).target


def in_state(ids: list[int], state: str) -> Any:
    """The orders among ``ids`` whose state field holds ``state``."""
    model = get_order_model()
    return model._default_manager.filter(pk__in=ids, **{state_field(model).name: state})


#: Demo customers per run; several orders each, so points add up across orders.
CUSTOMERS = 10


def build_messages(order: Any) -> list[tuple[str, dict[str, Any]]]:
    """The three messages of one order's life, with per-order sequence numbers."""
    money = {"amount": str(order.amount), "currency": order.currency}
    return [
        (
            "payments",
            {
                "message_id": f"pay-{order.business_key}",
                "type": "payment.succeeded",
                "order_id": order.pk,
                "seq": 1,
                "payload": {"payment_id": f"PAY-{order.pk}", **money},
            },
        ),
        (
            "shipping",
            {
                "message_id": f"dispatch-{order.business_key}",
                "type": "shipment.dispatched",
                "order_id": order.pk,
                "seq": 2,
                "payload": {"tracking_number": f"SF{order.pk:08d}", "carrier": "sf-express"},
            },
        ),
        (
            "shipping",
            {
                "message_id": f"deliver-{order.business_key}",
                "type": "shipment.delivered",
                "order_id": order.pk,
                "seq": 3,
                "payload": {"tracking_number": f"SF{order.pk:08d}", "carrier": "sf-express"},
            },
        ),
    ]


class Command(BaseCommand):
    help = (
        "Create orders, publish their payment and shipping messages with random duplicates "
        "in shuffled order to real Celery workers, wait, and check the invariants."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--orders", type=int, default=200)
        parser.add_argument("--workers", type=int, default=2, help="worker processes to start")
        parser.add_argument("--max-copies", type=int, default=3, help="copies per message, 1..N")
        parser.add_argument("--seed", type=int, default=None)
        parser.add_argument("--timeout", type=float, default=120.0)
        parser.add_argument(
            "--no-spawn",
            action="store_true",
            help="do not start workers; use ones already consuming the demo queue",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        rng = random.Random(opts["seed"])
        run = uuid.uuid4().hex[:8]
        queue = current_app.conf.task_default_queue
        self.stdout.write(
            f"demo run {run}: {opts['orders']} orders, database "
            f"{settings.DATABASES['default']['ENGINE'].rsplit('.', 1)[-1]}, broker "
            f"{current_app.conf.broker_url.split('://')[0]}, queue {queue!r}"
        )
        if not opts["no_spawn"]:
            self.purge(queue)
        # Each order's loyalty-points follow-up goes through the outbox, in the
        # order's own transaction; the payment and shipping messages below stand
        # for other systems and are published directly.
        orders = [
            place_order(
                business_key=f"demo-{run}-{i}",
                customer=f"demo-{run}-{i % CUSTOMERS}",
                amount=Decimal(rng.randint(100, 99999)) / 100,
                currency="CNY",
            )
            for i in range(opts["orders"])
        ]
        relay_outbox()  # whatever the on-commit publish could not send
        messages = [m for order in orders for m in build_messages(order)]
        deliveries = [m for m in messages for _ in range(rng.randint(1, opts["max_copies"]))]
        rng.shuffle(deliveries)

        workers: list[subprocess.Popen[bytes]] = []
        if not opts["no_spawn"]:
            workers = self.start_workers(opts["workers"], queue)
        started = time.monotonic()
        try:
            for consumer, message in deliveries:
                publish(message, consumer=consumer)
            self.stdout.write(
                f"published {len(deliveries)} deliveries of {len(messages)} messages "
                f"({len(deliveries) - len(messages)} duplicates), shuffled"
            )
            self.wait(orders, opts["timeout"], started)
        finally:
            for proc in workers:
                if proc.poll() is None:
                    proc.terminate()  # warm shutdown: finish the current task, then exit
            for proc in workers:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        elapsed = time.monotonic() - started
        problems = self.report(orders, messages, deliveries, elapsed)
        if problems:
            raise CommandError("invariants broken:\n  " + "\n  ".join(problems))
        self.stdout.write(self.style.SUCCESS("all invariants hold"))

    def purge(self, queue: str) -> None:
        """Drop leftovers of an aborted earlier run from the demo's own queue."""
        with current_app.connection_for_write() as conn:
            # Declared the way Celery declares its default queue, then emptied.
            bound = Queue(queue, Exchange(queue), routing_key=queue)(conn.default_channel)
            bound.declare()
            bound.purge()

    def start_workers(self, count: int, queue: str) -> list[subprocess.Popen[bytes]]:
        log_dir = Path(getattr(settings, "STATE_DIR", "."))
        procs = []
        for i in range(count):
            log = (log_dir / f"worker-{i}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "celery",
                        "-A",
                        "demo_project",
                        "worker",
                        "-Q",
                        queue,
                        "-c",
                        "1",
                        "-n",
                        f"demo{i}@%h",
                        "--loglevel",
                        "WARNING",
                        "--without-gossip",
                        "--without-mingle",
                        "--without-heartbeat",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=os.environ.copy(),
                    start_new_session=True,
                )
            )
        self.stdout.write(f"started {count} worker processes (logs in {log_dir}/worker-*.log)")
        return procs

    def wait(self, orders: list[AbstractOrder], timeout: float, started: float) -> None:
        ids = [o.pk for o in orders]
        last: tuple[int, int, int] = (-1, -1, -1)
        final = final_state()
        while True:
            done = in_state(ids, final).count()
            # The run is over when every order's fulfilment step was recorded and
            # its loyalty points (the outbox follow-up) were awarded too.
            steps = (
                ProcessedMessage.objects.filter(consumer="fulfilment", order_id__in=ids).count()
                if conf.FULFIL_AFTER_PAYMENT
                else len(ids)
            )
            awarded = ProcessedMessage.objects.filter(
                consumer="loyalty", message_id__in=[points_message_id(pk) for pk in ids]
            ).count()
            if (done, steps, awarded) != last:
                self.stdout.write(
                    f"  {time.monotonic() - started:5.1f}s  completed {done}/{len(ids)}, "
                    f"fulfilment steps {steps}/{len(ids)}, points awarded {awarded}/{len(ids)}"
                )
                last = (done, steps, awarded)
            if done == steps == awarded == len(ids):
                return
            if time.monotonic() - started > timeout:
                self.stdout.write(self.style.WARNING(f"timed out after {timeout:.0f}s"))
                return
            time.sleep(0.5)

    def report(
        self,
        orders: list[Any],
        messages: list[tuple[str, dict[str, Any]]],
        deliveries: list[tuple[str, dict[str, Any]]],
        elapsed: float,
    ) -> list[str]:
        ids = [o.pk for o in orders]
        problems: list[str] = []
        rows = ProcessedMessage.objects.filter(order_id__in=ids)
        outcomes = Counter(rows.values_list("outcome", flat=True))
        final = final_state()
        orders_in_run = get_order_model()._default_manager.filter(pk__in=ids)
        not_completed = orders_in_run.exclude(pk__in=in_state(ids, final).values("pk"))
        if not_completed.exists():
            problems.append(f"{not_completed.count()} orders did not reach {final}")
        expected = {(c, m["message_id"]) for c, m in messages}
        recorded = set(rows.values_list("consumer", "message_id"))
        lost = expected - recorded
        if lost:
            problems.append(f"{len(lost)} messages were never recorded, e.g. {sorted(lost)[:3]}")
        # The inbox's unique index allows one row per message; a message counts as
        # applied at most once if every order's version equals its applied rows.
        applied = dict(
            orders_in_run.annotate(
                n=Count("inbox_messages", filter=Q(inbox_messages__outcome=Outcome.APPLIED))
            ).values_list("pk", "n")
        )
        versions = dict(orders_in_run.values_list("pk", "version"))
        inconsistent = [pk for pk in ids if versions[pk] != applied.get(pk, 0)]
        if inconsistent:
            problems.append(f"{len(inconsistent)} orders' version != applied messages")
        double = (
            ProcessedMessage.objects.filter(order_id__in=ids, outcome=Outcome.APPLIED)
            .values("consumer", "message_id")
            .annotate(n=Count("id"))
            .filter(n__gt=1)
            .count()
        )
        if double:
            problems.append(f"{double} messages applied more than once")
        if conf.FULFIL_AFTER_PAYMENT:
            steps = rows.filter(consumer="fulfilment").count()
            if steps != len(ids):
                problems.append(f"{len(ids) - steps} orders' fulfilment step never ran")
        parked = ParkedMessage.objects.filter(order_id__in=ids).count()
        if parked:
            problems.append(f"{parked} messages still parked")
        rejected = list(
            rows.filter(outcome=Outcome.REJECTED).values_list("message_id", "error")[:5]
        )
        if rejected:
            problems.append(f"unexpected rejections: {rejected}")
        follow_ups = OutboxMessage.objects.filter(
            message_id__in=[points_message_id(pk) for pk in ids]
        )
        unsent = follow_ups.exclude(status=OutboxStatus.SENT).count()
        if follow_ups.count() != len(ids) or unsent:
            problems.append(
                f"{follow_ups.count()} follow-ups for {len(ids)} orders, {unsent} unsent"
            )
        expected_points: Counter[str] = Counter()
        for i, order in enumerate(orders):
            expected_points[f"{order.business_key.rsplit('-', 1)[0]}-{i % CUSTOMERS}"] += (
                int(order.amount) * POINTS_PER_UNIT
            )
        points = dict(
            LoyaltyAccount.objects.filter(customer__in=expected_points).values_list(
                "customer", "points"
            )
        )
        wrong_points = [c for c, n in expected_points.items() if points.get(c, 0) != n]
        if wrong_points:
            problems.append(f"{len(wrong_points)} customers' loyalty points are wrong")

        self.stdout.write("")
        self.stdout.write("report")
        self.stdout.write(f"  orders                 {len(ids)}")
        self.stdout.write(f"  completed              {len(ids) - not_completed.count()}")
        self.stdout.write(f"  messages               {len(messages)}")
        self.stdout.write(
            f"  deliveries published   {len(deliveries)} "
            f"({len(deliveries) - len(messages)} duplicate copies)"
        )
        self.stdout.write(
            f"  inbox rows             {sum(outcomes.values())} "
            "(one per message, incl. each order's fulfilment step; a copy answered"
            " before the database writes none)"
        )
        # Every message is published at once: a shipment message often reaches its order
        # before the fulfilment step the payment queued, which then finds nothing to do.
        late_steps = rows.filter(consumer="fulfilment", outcome=Outcome.STALE).count()
        for outcome in Outcome:
            line = f"    {outcome.value:<20} {outcomes.get(outcome.value, 0)}"
            if outcome is Outcome.STALE and late_steps:
                line += f" ({late_steps} fulfilment steps: the order was shipped before them)"
            self.stdout.write(line)
        self.stdout.write(f"  outbox follow-ups      {follow_ups.count()} ({unsent} unsent)")
        self.stdout.write(f"  wrong loyalty points   {len(wrong_points)}")
        self.stdout.write(f"  double-applied         {double}")
        self.stdout.write(f"  lost                   {len(lost)}")
        self.stdout.write(f"  still parked           {parked}")
        self.stdout.write(f"  version mismatches     {len(inconsistent)}")
        self.stdout.write(f"  elapsed                {elapsed:.1f}s")
        return problems
