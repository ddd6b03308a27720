"""@idempotent: once per key, the result recorded with the writes, duplicates under concurrency."""

from __future__ import annotations

import threading
import uuid
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection, transaction

from demo_project.models import LoyaltyAccount
from demo_project.tasks import award_points
from idempotent_orders.exceptions import InvalidMessage
from idempotent_orders.idempotent import idempotent
from idempotent_orders.models import InboxStatus, Outcome, ProcessedMessage
from idempotent_orders.signals import message_consumed
from tests.support.services import wait_until

calls: list[Any] = []


@idempotent(key="message_id", consumer="test-points")
def add_points(message: dict[str, Any]) -> dict[str, Any]:
    calls.append(message["message_id"])
    account, _ = LoyaltyAccount.objects.get_or_create(customer=message["customer"])
    account.points += message["points"]
    account.save()
    if message.get("fail"):
        raise RuntimeError("boom after the write")
    return {"awarded": message["points"], "amount": Decimal("1.50")}


def points_message(**extra: Any) -> dict[str, Any]:
    return {"message_id": f"pts-{uuid.uuid4().hex}", "customer": "alice", "points": 10, **extra}


def points(customer: str = "alice") -> int:
    row = LoyaltyAccount.objects.filter(customer=customer).first()
    return row.points if row else 0


@pytest.fixture(autouse=True)
def _reset_calls() -> None:
    calls.clear()


@pytest.mark.django_db
def test_first_run_records_its_result_and_a_duplicate_returns_it() -> None:
    msg = points_message()
    first = add_points(msg)
    # The JSON form is returned both times, so callers see one type either way.
    assert first == {"awarded": 10, "amount": "1.50"}
    assert add_points(dict(msg, points=99)) == first
    assert calls == [msg["message_id"]]
    assert points() == 10
    row = ProcessedMessage.objects.get(consumer="test-points", message_id=msg["message_id"])
    assert (row.status, row.outcome, row.result) == (InboxStatus.DONE, Outcome.APPLIED, first)


@pytest.mark.django_db
def test_a_failing_run_records_only_its_failure_and_runs_again() -> None:
    msg = points_message(fail=True)
    with pytest.raises(RuntimeError):
        add_points(msg)
    assert points() == 0  # the function's own write rolled back
    # Only the failure is kept (see test_idempotent_dead.py): no result, no outcome.
    row = ProcessedMessage.objects.get(message_id=msg["message_id"])
    assert (row.status, row.outcome, row.attempts) == (InboxStatus.PROCESSING, "", 1)
    msg["fail"] = False
    add_points(msg)
    assert points() == 10
    assert len(calls) == 2


@pytest.mark.django_db
def test_inside_a_caller_transaction_that_rolls_back_nothing_is_recorded() -> None:
    msg = points_message()

    def caller() -> None:
        with transaction.atomic():
            add_points(msg)
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        caller()
    assert not ProcessedMessage.objects.filter(message_id=msg["message_id"]).exists()
    add_points(msg)
    assert points() == 10


@pytest.mark.django_db
def test_key_sources() -> None:
    seen: list[str] = []

    @idempotent(key=lambda order_id, **kw: f"receipt-{order_id}", consumer="test-receipts")
    def receipt(order_id: int, *, copies: int = 1) -> int:
        seen.append(str(order_id))
        return copies

    assert receipt(7, copies=2) == 2
    assert receipt(7, copies=5) == 2
    assert seen == ["7"]

    @idempotent(key="email_id", consumer="test-email")
    def send(*, email_id: int) -> None:
        seen.append("sent")

    send(email_id=12)
    send(email_id=12)
    assert seen.count("sent") == 1
    assert ProcessedMessage.objects.filter(consumer="test-email", message_id="12").exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "bad", [{}, {"message_id": ""}, {"message_id": None}, {"message_id": "a\nb"}]
)
def test_unusable_key_raises(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidMessage):
        add_points(bad)
    assert calls == []


def test_consumer_name_defaults_to_the_dotted_path_and_is_bounded() -> None:
    def f(m: dict[str, Any]) -> None: ...

    f.__qualname__ = "f"
    assert idempotent(f, key="k").consumer == "tests.http.test_idempotent.f"  # type: ignore[attr-defined]
    f.__qualname__ = "x" * 64
    with pytest.raises(ValueError, match="longer than 64"):
        idempotent(f, key="k")


@pytest.mark.django_db
def test_signal_after_commit(django_capture_on_commit_callbacks: Any) -> None:
    got: list[str] = []

    def receiver(outcome: Outcome, consumer: str, **kw: Any) -> None:
        if consumer == "test-points":
            got.append(outcome.value)

    message_consumed.connect(receiver)
    try:
        msg = points_message()
        with django_capture_on_commit_callbacks(execute=True):
            add_points(msg)
            add_points(msg)
    finally:
        message_consumed.disconnect(receiver)
    assert got == ["applied", "duplicate"]


@pytest.mark.django_db
def test_on_a_bound_celery_task_the_key_skips_self() -> None:
    msg = {"message_id": f"m-{uuid.uuid4().hex}", "customer": "bob", "points": 3}
    assert award_points.apply(args=[msg]).get() == {"customer": "bob", "awarded": 3}
    assert award_points.apply(args=[msg]).get() == {"customer": "bob", "awarded": 3}
    assert points("bob") == 3


@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db(transaction=True)
def test_50_concurrent_duplicates_in_threads_add_points_once() -> None:
    msg = points_message()
    barrier = threading.Barrier(50)
    results: list[Any] = []
    errors: list[BaseException] = []

    def deliver() -> None:
        try:
            barrier.wait()
            results.append(award_points(msg))
        except BaseException as exc:  # report, never hang the barrier
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=deliver) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert results == [{"customer": "alice", "awarded": 10}] * 50
    assert points() == 10
    assert ProcessedMessage.objects.filter(message_id=msg["message_id"]).count() == 1


@pytest.mark.services
@pytest.mark.workers
@pytest.mark.backends("postgresql")
def test_50_duplicate_deliveries_to_real_workers_add_points_once(celery_workers: Any) -> None:
    workers = celery_workers("redis", processes=2, concurrency=2)
    msg = points_message()
    for _ in range(50):
        award_points.apply_async(args=[msg], task_id=msg["message_id"])

    def finished() -> int:
        return sum(
            log.read_text(errors="replace").count("succeeded")
            for log in workers.logs
            if log.exists()
        )

    assert wait_until(lambda: finished() >= 50, timeout=120), workers.log_tail()
    assert points() == 10
    assert ProcessedMessage.objects.filter(message_id=msg["message_id"]).count() == 1
