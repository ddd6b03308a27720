"""Real processes: a worker killed mid-effect, and two reconcilers racing on the same rows."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from demo_project import warehouse, webhooks
from demo_project.models import WarehouseRequest, WebhookDelivery
from demo_project.tasks import notify_partner
from idempotent_orders import leases, reconcile
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.fulfilment import fulfil, fulfilment_message_id
from idempotent_orders.leases import StepResult
from idempotent_orders.models import InboxStatus, Order, OrderStatus, ProcessedMessage
from idempotent_orders.tasks import fulfil_order
from tests.support.messages import payment
from tests.support.services import ROOT, wait_until

S = OrderStatus
LEASE = 3


def paid_order(make_order) -> Order:
    order = make_order()
    consume_message(payment(order), consumer="payments")
    return order


def inbox(order: Order) -> ProcessedMessage:
    return ProcessedMessage.objects.get(
        consumer="fulfilment", message_id=fulfilment_message_id(order.pk)
    )


@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
def test_worker_killed_between_claim_and_completion(celery_workers, make_order) -> None:
    """The reconciler finishes each killed claim exactly once: one warehouse effect each.

    ``done`` reached the warehouse before the kill (the reconciler verifies and
    completes without calling again); ``lost`` was killed before any effect
    (the reconciler calls again, once). A third worker stays alive and gets the
    broker's redeliveries of the killed tasks: it must not act on live or
    expired claims (only the reconciler, which verifies, takes those over).
    """
    done, lost = paid_order(make_order), paid_order(make_order)
    warehouse.script(done.pk, "effect_then_hang")
    warehouse.script(lost.pk, "hang")
    workers = celery_workers(
        "rabbitmq", processes=3, extra_env={"IO_TEST_LEASE_SECONDS": str(LEASE)}
    )
    for order in (done, lost):
        fulfil_order.apply_async(args=[order.pk], task_id=fulfilment_message_id(order.pk))

    def in_warehouse() -> bool:
        return WarehouseRequest.objects.filter(order_id__in=[done.pk, lost.pk]).count() == 2

    assert wait_until(in_warehouse, timeout=90), workers.log_tail()
    for order in (done, lost):
        assert inbox(order).status == InboxStatus.PROCESSING
    # While the calls hang, the workers' heartbeats keep the leases alive past LEASE.
    time.sleep(LEASE + 1)
    assert leases.expired().count() == 0, workers.log_tail()
    # Kill the worker process (group) that runs each hanging call.
    killed = workers.kill_holders(r.pid for r in WarehouseRequest.objects.all())
    assert len(killed) == 2, workers.log_tail()

    def expired() -> bool:
        return leases.expired().count() == 2

    assert wait_until(expired, timeout=LEASE * 10), workers.log_tail()
    report = reconcile.reconcile()
    assert report.actions == {"completed": 2}, workers.log_tail()
    assert reconcile.reconcile().actions == {}

    for order in (done, lost):
        row = Order.objects.get(pk=order.pk)
        assert (row.status, row.version) == (S.PROCESSING, 2)
        assert inbox(order).status == InboxStatus.DONE
        assert warehouse.effects(order.pk) == 1
    assert WarehouseRequest.objects.filter(order_id=done.pk).count() == 1  # verified, not redone
    assert WarehouseRequest.objects.filter(order_id=lost.pk).count() == 2  # redone once
    # The surviving worker received the redeliveries and did nothing with them.
    survivor = next(i for i in range(3) if i not in killed)
    assert workers.procs[survivor].poll() is None
    assert fulfil(done.pk) is not StepResult.RETRY


def run_reconciler(limit: int) -> subprocess.Popen[str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "IO_WORKER_DB": "1"}
    return subprocess.Popen(
        [sys.executable, "manage.py", "reconcile_orders", "--until-empty", f"--limit={limit}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.races
@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db(transaction=True)
def test_two_reconcilers_never_double_act(make_order) -> None:
    """Two reconciler processes on the same stuck rows: every row is acted on once."""
    orders = [paid_order(make_order) for _ in range(40)]
    for order in orders:
        warehouse.script(order.pk, "fail", "slow")
        assert fulfil(order.pk) is StepResult.RETRY
    procs = [run_reconciler(limit=5) for _ in range(2)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    for order in orders:
        assert Order.objects.get(pk=order.pk).status == S.PROCESSING
        assert warehouse.effects(order.pk) == 1, outputs
    # One refused call each, then exactly one successful call.
    assert WarehouseRequest.objects.count() == 2 * len(orders)
    per_process = [
        sum(
            int(part.split("=")[1])
            for row in out.splitlines()
            for part in row.split(", ")
            if part.startswith("completed=")
        )
        for out in outputs
    ]
    assert sum(per_process) == len(orders), outputs
    # Both really ran at once: each completed some of the rows.
    assert all(n > 0 for n in per_process), outputs


def run_reconcile_command() -> str:
    """One ``manage.py reconcile_orders`` pass in a fresh process (it imports no task modules)."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "IO_WORKER_DB": "1"}
    done = subprocess.run(
        [sys.executable, "manage.py", "reconcile_orders"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
def test_external_call_killed_between_claim_and_completion(celery_workers) -> None:
    """``@idempotent(external=True)``: a killed call is finished once by the reconciler.

    ``reached`` got to the partner before its worker died (the reconciler
    verifies and completes without sending again); ``lost`` died before (the
    reconciler sends again, once, with the same idempotency key). The reconciler
    runs as ``manage.py reconcile_orders``, which must find the step by itself.
    """
    reached, lost = (
        {"message_id": f"evt-{name}-{uuid.uuid4().hex[:8]}", "data": {"n": 1}}
        for name in ("reached", "lost")
    )
    webhooks.script(reached["message_id"], "effect_then_hang")
    webhooks.script(lost["message_id"], "hang")
    workers = celery_workers(
        "rabbitmq", processes=3, extra_env={"IO_TEST_LEASE_SECONDS": str(LEASE)}
    )
    for msg in (reached, lost):
        notify_partner.apply_async(args=[msg], task_id=msg["message_id"])
    refs = [reached["message_id"], lost["message_id"]]

    def called() -> bool:
        return WebhookDelivery.objects.filter(ref__in=refs).count() == 2

    assert wait_until(called, timeout=90), workers.log_tail()
    rows = ProcessedMessage.objects.filter(consumer="partner-webhook", message_id__in=refs)
    assert {r.status for r in rows} == {InboxStatus.PROCESSING}
    killed = workers.kill_holders(r.pid for r in WebhookDelivery.objects.filter(ref__in=refs))
    assert len(killed) == 2, workers.log_tail()

    def expired() -> bool:
        return leases.expired().filter(consumer="partner-webhook").count() == 2

    assert wait_until(expired, timeout=LEASE * 10), workers.log_tail()
    assert run_reconcile_command() == "completed=2", workers.log_tail()
    assert run_reconcile_command() == "nothing to do"

    for ref in refs:
        assert webhooks.effects(ref) == 1
        inbox = ProcessedMessage.objects.get(consumer="partner-webhook", message_id=ref)
        assert (inbox.status, inbox.outcome) == (InboxStatus.DONE, "applied")
    assert WebhookDelivery.objects.filter(ref=refs[0]).count() == 1  # verified, not resent
    assert WebhookDelivery.objects.filter(ref=refs[1]).count() == 2  # resent once
    # The survivor got the killed tasks' redeliveries and left them to the reconciler.
    survivor = next(i for i in range(3) if i not in killed)
    assert workers.procs[survivor].poll() is None
    assert notify_partner(lost) == {"notified": lost["message_id"]}
    assert WebhookDelivery.objects.filter(ref__in=refs).count() == 3
