"""@idempotent dead letters: work that keeps failing ends dead, visible and requeueable."""

from __future__ import annotations

import json
import threading
import time
import uuid
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.checks import run_checks
from django.core.management import CommandError, call_command
from django.db import OperationalError, connection, transaction
from django.test import Client, override_settings
from django.urls import reverse

from demo_project.models import LoyaltyAccount
from idempotent_orders import leases
from idempotent_orders.exceptions import MessageDead, PermanentFailure
from idempotent_orders.idempotent import idempotent, inbox_stats, requeue_inbox
from idempotent_orders.models import AuditEntry, InboxStatus, Outcome, ProcessedMessage
from idempotent_orders.signals import message_dead
from tests.support.admin import requeue_refused_to_a_viewer, shown
from tests.support.metrics import sample
from tests.support.services import wait_until

#: What the next run of ``flaky`` does: "ok", or an exception instance to raise.
behaviour: dict[str, Any] = {"next": "ok"}
runs: list[str] = []


@idempotent(key="message_id", consumer="test-flaky")
def flaky(message: dict[str, Any]) -> dict[str, Any]:
    runs.append(message["message_id"])
    # A write that must roll back with a failed run.
    account, _ = LoyaltyAccount.objects.get_or_create(customer=message["message_id"])
    account.points += 1
    account.save()
    if behaviour["next"] != "ok":
        raise behaviour["next"]
    return {"ran": len(runs)}


@idempotent(key="message_id", consumer="test-strict", permanent=(ValueError,), max_attempts=5)
def strict(message: dict[str, Any]) -> str:
    runs.append(message["message_id"])
    if message.get("bad"):
        raise ValueError("no such customer")
    if message.get("flaky"):
        raise ConnectionError("partner down")
    return "ok"


def new_message(**extra: Any) -> dict[str, Any]:
    return {"message_id": f"m-{uuid.uuid4().hex}", **extra}


def row(message: dict[str, Any], consumer: str = "test-flaky") -> ProcessedMessage:
    return ProcessedMessage.objects.get(consumer=consumer, message_id=message["message_id"])


def points(message: dict[str, Any]) -> int:
    account = LoyaltyAccount.objects.filter(customer=message["message_id"]).first()
    return account.points if account else 0


@pytest.fixture(autouse=True)
def _reset() -> None:
    behaviour["next"] = "ok"
    runs.clear()


@pytest.fixture
def dead_signals() -> Any:
    seen: list[dict[str, Any]] = []
    message_dead.connect(lambda **kw: seen.append(kw), weak=False, dispatch_uid="test-inbox-dead")
    yield seen
    message_dead.disconnect(dispatch_uid="test-inbox-dead")


@pytest.mark.django_db
def test_a_failed_run_is_recorded_as_processing_with_its_error_and_runs_again() -> None:
    msg = new_message()
    behaviour["next"] = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        flaky(msg)
    failed = row(msg)
    # The run's writes rolled back; the failure is kept for the next delivery.
    assert points(msg) == 0
    assert (failed.status, failed.outcome, failed.attempts) == (InboxStatus.PROCESSING, "", 1)
    assert failed.error == "RuntimeError: boom"
    assert failed.lease_expires_at is None
    behaviour["next"] = "ok"
    assert flaky(msg) == {"ran": 2}
    done = row(msg)
    assert (done.status, done.outcome, done.attempts) == (InboxStatus.DONE, Outcome.APPLIED, 2)
    assert points(msg) == 1
    assert flaky(msg) == {"ran": 2}  # a duplicate now
    assert len(runs) == 2


@pytest.mark.django_db
@override_settings(IDEMPOTENT_ORDERS={"IDEMPOTENT_MAX_ATTEMPTS": 3})
def test_max_attempts_failures_make_the_row_dead_and_redeliveries_do_not_run(
    dead_signals: list[dict[str, Any]], django_capture_on_commit_callbacks: Any
) -> None:
    msg = new_message()
    behaviour["next"] = RuntimeError("still broken")
    with django_capture_on_commit_callbacks(execute=True):
        for _ in range(2):
            with pytest.raises(RuntimeError):
                flaky(msg)
        assert row(msg).attempts == 2
        assert dead_signals == []
        with pytest.raises(MessageDead) as died:
            flaky(msg)
    assert isinstance(died.value.__cause__, RuntimeError)
    dead = row(msg)
    assert (dead.status, dead.attempts, dead.error) == (
        InboxStatus.DEAD,
        3,
        "RuntimeError: still broken",
    )
    assert dead.dead_at is not None
    assert dead_signals == [
        {
            "signal": message_dead,
            "sender": ProcessedMessage,
            "consumer": "test-flaky",
            "message_id": msg["message_id"],
            "attempts": 3,
            "error": "RuntimeError: still broken",
        }
    ]
    behaviour["next"] = "ok"
    for _ in range(3):  # answered "dead" without running, even once fixed
        with pytest.raises(MessageDead, match="dead"):
            flaky(msg)
    assert len(runs) == 3
    assert len(dead_signals) == 1
    assert points(msg) == 0


@pytest.mark.django_db
def test_a_failing_row_an_operator_marked_failed_does_not_run() -> None:
    msg = new_message()
    behaviour["next"] = RuntimeError("boom")
    with pytest.raises(RuntimeError):
        flaky(msg)
    assert leases.fail(row(msg).pk, reason="failed by an operator")
    behaviour["next"] = "ok"
    with pytest.raises(MessageDead, match="is failed: failed by an operator"):
        flaky(msg)
    assert len(runs) == 1


@pytest.mark.django_db
def test_a_permanent_failure_is_dead_at_once(dead_signals: list[dict[str, Any]]) -> None:
    msg = new_message()
    behaviour["next"] = PermanentFailure("the order was deleted")
    with pytest.raises(MessageDead):
        flaky(msg)
    dead = row(msg)
    assert (dead.status, dead.attempts) == (InboxStatus.DEAD, 1)
    assert dead.error == "PermanentFailure: the order was deleted"


@pytest.mark.django_db
def test_permanent_exception_types_and_max_attempts_of_the_decorator() -> None:
    bad, flaky_msg = new_message(bad=True), new_message(flaky=True)
    with pytest.raises(MessageDead):
        strict(bad)
    assert row(bad, "test-strict").status == InboxStatus.DEAD
    for _ in range(4):
        with pytest.raises(ConnectionError):
            strict(flaky_msg)
    with pytest.raises(MessageDead):
        strict(flaky_msg)
    assert row(flaky_msg, "test-strict").attempts == 5
    with pytest.raises(ValueError, match="max_attempts"):
        idempotent(lambda m: None, key="message_id", consumer="x", max_attempts=0)


@pytest.mark.django_db
def test_inside_a_caller_transaction_the_failure_record_is_the_callers() -> None:
    kept, dropped = new_message(), new_message()
    behaviour["next"] = RuntimeError("boom")
    with transaction.atomic(), pytest.raises(RuntimeError):
        flaky(kept)  # caught: the caller commits, the failure is recorded
    assert row(kept).attempts == 1
    with pytest.raises(RuntimeError), transaction.atomic():
        flaky(dropped)  # the caller rolls back: nothing recorded, as before
    assert not ProcessedMessage.objects.filter(message_id=dropped["message_id"]).exists()


@pytest.mark.django_db
def test_requeue_puts_only_dead_rows_back_and_the_next_delivery_runs_once() -> None:
    msg, other = new_message(), new_message()
    behaviour["next"] = PermanentFailure("bad data")
    for m in (msg, other):
        with pytest.raises(MessageDead):
            flaky(m)
    behaviour["next"] = "ok"
    done = new_message()
    flaky(done)
    assert requeue_inbox(consumer="test-flaky", message_ids=[msg["message_id"]], dry_run=True) == 1
    assert row(msg).status == InboxStatus.DEAD
    ids = [msg["message_id"], done["message_id"]]
    assert requeue_inbox(consumer="test-flaky", message_ids=ids) == 1
    requeued = row(msg)
    assert (requeued.status, requeued.attempts, requeued.dead_at) == (
        InboxStatus.PROCESSING,
        0,
        None,
    )
    assert requeued.error == "PermanentFailure: bad data"  # kept as the record
    assert row(other).status == InboxStatus.DEAD
    assert row(done).status == InboxStatus.DONE
    runs.clear()
    first = flaky(msg)
    assert flaky(msg) == first
    assert runs == [msg["message_id"]]
    assert (row(msg).status, row(msg).attempts) == (InboxStatus.DONE, 1)
    assert points(msg) == 1


@pytest.mark.django_db
def test_requeue_command() -> None:
    a, b = new_message(), new_message()
    behaviour["next"] = PermanentFailure("bad")
    for m in (a, b):
        with pytest.raises(MessageDead):
            flaky(m)
    with pytest.raises(CommandError, match="--all-dead"):
        call_command("requeue_idempotent")
    with pytest.raises(CommandError, match="--consumer"):
        call_command("requeue_idempotent", "--message-id", a["message_id"])
    out = StringIO()
    call_command("requeue_idempotent", "--all-dead", "--dry-run", stdout=out)
    assert out.getvalue().strip() == "would requeue=2"
    out = StringIO()
    call_command(
        "requeue_idempotent",
        "--consumer",
        "test-flaky",
        "--message-id",
        a["message_id"],
        stdout=out,
    )
    assert out.getvalue().strip() == "requeued=1"
    assert (row(a).status, row(b).status) == (InboxStatus.PROCESSING, InboxStatus.DEAD)
    out = StringIO()
    call_command("requeue_idempotent", "--consumer", "test-flaky", "--all-dead", stdout=out)
    assert out.getvalue().strip() == "requeued=1"
    assert inbox_stats()["dead"] == 0


def changelist() -> str:
    return reverse("admin:idempotent_orders_processedmessage_changelist")


def _dead(consumer: str = "test-flaky") -> ProcessedMessage:
    msg = new_message()
    behaviour["next"] = PermanentFailure("bad data")
    with pytest.raises(MessageDead):
        flaky(msg)
    return row(msg)


@pytest.mark.django_db
def test_admin_requeue_confirms_then_requeues_and_audits(staff: Client) -> None:
    dead, other = _dead(), _dead()
    ProcessedMessage.objects.filter(pk=other.pk).update(status=InboxStatus.DONE)
    selected = {"action": "requeue_dead", "_selected_action": [dead.pk, other.pk]}

    page = staff.post(changelist(), selected)
    assert page.status_code == 200
    html = page.content.decode()
    assert "are you sure?" in html
    assert "nothing: not dead" in html
    assert "PermanentFailure: bad data" in html
    assert row({"message_id": dead.message_id}).status == InboxStatus.DEAD  # not yet

    done = staff.post(changelist(), {**selected, "post": "yes"}, follow=True)
    assert "Requeue: 1 requeued, 1 skipped." in shown(done)
    assert ProcessedMessage.objects.get(pk=dead.pk).status == InboxStatus.PROCESSING
    assert ProcessedMessage.objects.get(pk=other.pk).status == InboxStatus.DONE
    entries = {(e.action, e.object_id, e.result, e.username) for e in AuditEntry.objects.all()}
    assert entries == {
        ("inbox:requeue", str(dead.pk), "requeued", "operator"),
        ("inbox:requeue", str(other.pk), "skipped", "operator"),
    }
    detail = AuditEntry.objects.get(object_id=str(dead.pk)).detail
    assert detail == "dead after 1 attempt(s): PermanentFailure: bad data; now processing"


@pytest.mark.django_db
def test_admin_requeue_needs_the_change_permission() -> None:
    dead = _dead()
    requeue_refused_to_a_viewer("view_processedmessage", changelist(), dead.pk)
    assert ProcessedMessage.objects.get(pk=dead.pk).status == InboxStatus.DEAD
    assert not AuditEntry.objects.exists()


@pytest.mark.django_db
def test_dead_rows_in_stats_command_dashboard_filter_and_metrics(
    staff: Client, django_capture_on_commit_callbacks: Any
) -> None:
    def lettered() -> float:
        text = Client().get("/metrics").content.decode()
        return sample(text, "idempotent_orders_inbox_dead_lettered_total", consumer="test-flaky")

    before = lettered()
    with django_capture_on_commit_callbacks(execute=True):
        _dead()
        _dead()
    out = StringIO()
    call_command("idempotent_orders_stats", "--json", stdout=out)
    assert json.loads(out.getvalue())["inbox:dead"] == 2
    text = Client().get("/metrics").content.decode()
    assert sample(text, "idempotent_orders_inbox_dead") == 2
    assert lettered() - before == 2

    index = staff.get(reverse("admin:app_list", args=["idempotent_orders"])).content.decode()
    assert 'id="attention-inbox_dead"' in index
    listed = staff.get(changelist() + "?attention=dead")
    assert listed.context["cl"].result_count == 2


def test_max_attempts_below_one_is_an_error() -> None:
    with override_settings(IDEMPOTENT_ORDERS={"IDEMPOTENT_MAX_ATTEMPTS": 0}):
        assert "idempotent_orders.E036" in [m.id for m in run_checks()]


@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db(transaction=True)
def test_concurrent_deliveries_of_a_failing_message_count_every_failure_once() -> None:
    """Twenty deliveries at once, each failing: one row, twenty attempts, dead at the limit.

    A delivery that a deadlock stopped before it ran (MySQL, inserts waiting on
    one key) is delivered again, as Celery retries transient errors; it is not
    counted as an attempt.
    """
    msg = new_message()
    behaviour["next"] = RuntimeError("down")
    barrier = threading.Barrier(20)
    errors: list[str] = []

    def deliver() -> None:
        try:
            barrier.wait()
            while True:
                try:
                    flaky(msg)
                except OperationalError:
                    continue
                break
        except BaseException as exc:
            errors.append(type(exc).__name__)
        finally:
            connection.close()

    with override_settings(IDEMPOTENT_ORDERS={"IDEMPOTENT_MAX_ATTEMPTS": 20}):
        threads = [threading.Thread(target=deliver) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    dead = row(msg)
    assert (dead.status, dead.attempts) == (InboxStatus.DEAD, 20)
    assert sorted(errors) == ["MessageDead"] + ["RuntimeError"] * 19
    assert len(runs) == 20
    assert points(msg) == 0


@pytest.mark.services
@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
def test_real_worker_dead_once_never_retried_then_requeued_runs_once(
    celery_workers: Any, tmp_path: Any
) -> None:
    """A task Celery retries forever on any error: the dead letter stops it.

    ``missing`` fails permanently (one run, dead); ``down`` fails every time
    (three runs: ``max_attempts=3``, Celery's retries included, then dead). More
    deliveries of either run nothing. Fixed and requeued, each runs once more and
    succeeds once, however often it is delivered.
    """
    from tests.support.dead_tasks import fragile_points

    workers = celery_workers("redis", processes=1, concurrency=2)
    runs = tmp_path / "runs"
    runs.touch()
    messages = {}
    for name in ("missing", "down"):
        switch = tmp_path / name
        switch.write_text(name)
        messages[name] = {
            "message_id": f"frag-{name}-{uuid.uuid4().hex}",
            "customer": f"frag-{name}-{uuid.uuid4().hex[:8]}",
            "points": 7,
            "runs": str(runs),
            "switch": str(switch),
        }

    def ran(msg: dict[str, Any]) -> int:
        return runs.read_text().splitlines().count(msg["message_id"])

    def ignored() -> int:
        return sum(log.read_text(errors="replace").count("ignored") for log in workers.logs)

    def status(msg: dict[str, Any]) -> str:
        found = ProcessedMessage.objects.filter(
            consumer="test-fragile", message_id=msg["message_id"]
        ).first()
        return found.status if found else ""

    for msg in messages.values():
        fragile_points.apply_async(args=[msg], task_id=msg["message_id"])
    assert wait_until(lambda: ignored() >= 2, timeout=90), workers.log_tail()
    assert [status(m) for m in messages.values()] == [InboxStatus.DEAD] * 2
    for msg in messages.values():  # redeliveries answer "dead": no run, no retry
        for _ in range(3):
            fragile_points.apply_async(args=[msg], task_id=msg["message_id"])
    assert wait_until(lambda: ignored() >= 8, timeout=90), workers.log_tail()
    time.sleep(2)  # a retry Celery scheduled would have run by now
    assert (ran(messages["missing"]), ran(messages["down"])) == (1, 3), workers.log_tail()
    assert ignored() == 8
    missing = ProcessedMessage.objects.get(message_id=messages["missing"]["message_id"])
    assert (missing.attempts, missing.error) == (
        1,
        f"LookupError: no customer {messages['missing']['customer']}",
    )
    assert ProcessedMessage.objects.get(message_id=messages["down"]["message_id"]).attempts == 3

    for msg in messages.values():
        Path(msg["switch"]).write_text("ok")
    out = StringIO()
    call_command("requeue_idempotent", "--consumer", "test-fragile", "--all-dead", stdout=out)
    assert out.getvalue().strip() == "requeued=2"
    for msg in messages.values():
        for _ in range(5):
            fragile_points.apply_async(args=[msg], task_id=msg["message_id"])

    def succeeded() -> int:
        return sum(log.read_text(errors="replace").count("succeeded") for log in workers.logs)

    assert wait_until(lambda: succeeded() >= 10, timeout=90), workers.log_tail()
    assert (ran(messages["missing"]), ran(messages["down"])) == (2, 4)
    for msg in messages.values():
        assert status(msg) == InboxStatus.DONE
        assert LoyaltyAccount.objects.get(customer=msg["customer"]).points == 7
