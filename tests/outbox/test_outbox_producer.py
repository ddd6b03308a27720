"""The cheap producer: publishing after commit happens off the caller's thread; a looping
relay wakes on PostgreSQL NOTIFY and stops cleanly on SIGTERM.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from demo_project.tasks import award_points
from idempotent_orders import tracing
from idempotent_orders.models import OutboxMessage, OutboxStatus
from idempotent_orders.outbox import (
    Publisher,
    flush_publisher,
    publish_on_commit,
    relay,
    relay_outbox,
    sender,
)
from idempotent_orders.outbox.relay import _publish_unkeyed
from tests.support.services import ROOT, stop_processes, wait_until, worker_env


def message() -> dict[str, Any]:
    return {"message_id": f"out-{uuid.uuid4().hex}", "customer": "erin", "points": 5}


def status(row: OutboxMessage) -> str:
    return OutboxMessage.objects.get(pk=row.pk).status


@pytest.mark.django_db(transaction=True)
def test_the_committing_thread_does_not_wait_for_the_broker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker_answers = threading.Event()
    threads: list[str] = []

    def slow_broker(args: Any = None, task_id: str | None = None, **options: Any) -> None:
        threads.append(threading.current_thread().name)
        assert broker_answers.wait(60)

    monkeypatch.setattr(award_points, "apply_async", slow_broker)
    with transaction.atomic():
        row = publish_on_commit(award_points, message())
    # Committed and returned while the broker has not answered: the publish is elsewhere.
    assert wait_until(lambda: threads != [], timeout=30)
    assert status(row) == OutboxStatus.PENDING
    broker_answers.set()
    assert flush_publisher(timeout=30)
    assert status(row) == OutboxStatus.SENT
    assert threads == ["idempotent-orders-outbox"]


@pytest.mark.django_db(transaction=True)
def test_in_the_callers_thread_when_the_publisher_thread_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads: list[str] = []
    monkeypatch.setattr(
        award_points, "apply_async", lambda **kw: threads.append(threading.current_thread().name)
    )
    off = override_settings(IDEMPOTENT_ORDERS={"OUTBOX_PUBLISHER_THREAD": False})
    with off, transaction.atomic():
        row = publish_on_commit(award_points, message())
    assert threads == [threading.current_thread().name]
    assert status(row) == OutboxStatus.SENT


@pytest.mark.django_db(transaction=True)
def test_a_full_queue_leaves_the_row_to_the_relay(monkeypatch: pytest.MonkeyPatch) -> None:
    class Small(Publisher):
        capacity = 1
        linger = 0.0  # publish the first row alone

    small = Small()
    monkeypatch.setattr("idempotent_orders.outbox.thread.publisher", small)
    release = threading.Event()
    sent: list[str | None] = []

    def blocked(args: Any = None, task_id: str | None = None, **options: Any) -> None:
        assert release.wait(60)
        sent.append(task_id)

    monkeypatch.setattr(award_points, "apply_async", blocked)
    first = publish_on_commit(award_points, message())  # autocommit: handed over at once
    assert wait_until(lambda: small._busy and not small._pending)
    second = publish_on_commit(award_points, message())  # fills the queue
    third = publish_on_commit(award_points, message())  # does not fit: left to the relay
    release.set()
    assert small.flush(30)
    assert sent == [first.message_id, second.message_id]
    assert status(third) == OutboxStatus.PENDING


@pytest.mark.django_db(transaction=True)
def test_a_lone_id_is_published_at_once_not_after_the_batching_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Patient(Publisher):
        linger = 3600.0  # were the idle thread to wait for company, it would wait an hour

    patient = Patient()
    monkeypatch.setattr("idempotent_orders.outbox.thread.publisher", patient)
    sent: list[str | None] = []
    monkeypatch.setattr(award_points, "apply_async", lambda **kw: sent.append(kw["task_id"]))
    with transaction.atomic():
        row = publish_on_commit(award_points, message())
    assert patient.flush(30)
    assert sent == [row.message_id]
    assert status(row) == OutboxStatus.SENT


NO_IMMEDIATE = {"OUTBOX_PUBLISH_ON_COMMIT": False}
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db
def test_the_threads_batch_is_locked_and_marked_by_one_statement_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[tuple[str | None, dict[str, Any]]] = []
    failing: set[str] = set()

    def apply_async(task_id: str | None = None, **options: Any) -> None:
        if task_id in failing:
            raise ValueError("the broker refused this message")
        sent.append((task_id, options.get("headers", {})))

    monkeypatch.setattr(award_points, "apply_async", apply_async)
    with override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE), tracing.use(TRACE, "order-9"):
        plain = [publish_on_commit(award_points, message()) for _ in range(5)]
        keyed, later, done, dead, flaky = (
            publish_on_commit(award_points, message(), order_key="k" if n == 0 else None)
            for n in range(5)
        )
    OutboxMessage.objects.filter(pk=later.pk).update(
        available_at=timezone.now() + timedelta(hours=1)
    )
    OutboxMessage.objects.filter(pk=done.pk).update(status=OutboxStatus.SENT)
    OutboxMessage.objects.filter(pk=dead.pk).update(status=OutboxStatus.DEAD)
    OutboxMessage.objects.filter(pk=flaky.pk).update(attempts=3)
    failing.add(flaky.message_id)
    ids = [r.pk for r in (*plain, keyed, later, done, dead, flaky)]
    with CaptureQueriesContext(connection) as queries:
        result = _publish_unkeyed("default", ids)
    assert (result.published, result.retried, result.dead) == (5, 1, 0)
    assert [mid for mid, _ in sent] == [r.message_id for r in plain]
    # The row as read by the lock: its trace is sent, its attempts counted on.
    assert {headers["traceparent"] for _, headers in sent} == {TRACE}
    assert OutboxMessage.objects.get(pk=flaky.pk).attempts == 4
    statements = [q["sql"].lstrip().upper() for q in queries.captured_queries]
    (lock,) = [sql for sql in statements if sql.startswith("SELECT")]
    assert "SKIP LOCKED" in lock
    marks = [sql for sql in statements if sql.startswith("UPDATE") and "'SENT'" in sql]
    assert len(marks) == 1, statements
    status = dict(OutboxMessage.objects.values_list("pk", "status"))
    assert {status[r.pk] for r in plain} == {OutboxStatus.SENT}
    # A keyed row is left to the path that keeps its key's order; the others to the relay.
    assert [status[r.pk] for r in (keyed, later, dead, flaky)] == [
        OutboxStatus.PENDING,
        OutboxStatus.PENDING,
        OutboxStatus.DEAD,
        OutboxStatus.PENDING,
    ]
    assert relay_outbox(ids=[keyed.pk]).published == 1


@pytest.mark.backends("sqlite")
@pytest.mark.django_db(transaction=True)
def test_the_threads_batch_on_sqlite_is_claimed_and_marked_by_one_statement_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No read first: the claim itself takes only the due, pending, unkeyed rows that no
    # other relay holds, and the batch's mark is one UPDATE after the publishes.
    sent: list[str | None] = []
    failing: set[str] = set()

    def apply_async(task_id: str | None = None, **options: Any) -> None:
        if task_id in failing:
            raise ValueError("the broker refused this message")
        sent.append(task_id)

    monkeypatch.setattr(award_points, "apply_async", apply_async)
    with override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE):
        plain = [publish_on_commit(award_points, message()) for _ in range(5)]
        keyed, later, done, dead, flaky, held = (
            publish_on_commit(award_points, message(), order_key="k" if n == 0 else None)
            for n in range(6)
        )
    OutboxMessage.objects.filter(pk=later.pk).update(
        available_at=timezone.now() + timedelta(hours=1)
    )
    OutboxMessage.objects.filter(pk=done.pk).update(status=OutboxStatus.SENT)
    OutboxMessage.objects.filter(pk=dead.pk).update(status=OutboxStatus.DEAD)
    OutboxMessage.objects.filter(pk=flaky.pk).update(attempts=3)
    lease = timezone.now() + timedelta(minutes=1)  # another relay is publishing it
    OutboxMessage.objects.filter(pk=held.pk).update(claimed_until=lease)
    failing.add(flaky.message_id)
    ids = [r.pk for r in (*plain, keyed, later, done, dead, flaky, held)]
    with CaptureQueriesContext(connection) as queries:
        result = _publish_unkeyed("default", ids)
    assert (result.published, result.retried, result.dead) == (5, 1, 0)
    assert sent == [r.message_id for r in plain]
    statements = [q["sql"].lstrip().upper() for q in queries.captured_queries]
    assert not [sql for sql in statements if sql.startswith("SELECT")], statements
    (claim,) = [sql for sql in statements if "RETURNING" in sql]
    assert statements.index(claim) == 0, statements
    marks = [sql for sql in statements if sql.startswith("UPDATE") and "'SENT'" in sql]
    assert len(marks) == 1, statements
    rows = {r.pk: r for r in OutboxMessage.objects.all()}
    assert {rows[r.pk].status for r in plain} == {OutboxStatus.SENT}
    assert {rows[r.pk].claimed_until for r in plain} == {None}
    assert [rows[r.pk].status for r in (keyed, later, dead, flaky, held)] == [
        OutboxStatus.PENDING,
        OutboxStatus.PENDING,
        OutboxStatus.DEAD,
        OutboxStatus.PENDING,
        OutboxStatus.PENDING,
    ]
    # Left as they were: the keyed row and the one not yet due unclaimed, the other
    # relay's lease untouched; the failed row backs off, its attempts counted on.
    assert [rows[r.pk].claimed_until for r in (keyed, later)] == [None, None]
    assert rows[held.pk].claimed_until == lease
    assert rows[flaky.pk].attempts == 4
    assert rows[flaky.pk].claimed_until is None
    assert rows[flaky.pk].available_at > timezone.now()
    assert relay_outbox(ids=[keyed.pk]).published == 1


@pytest.mark.backends("sqlite")
@pytest.mark.django_db(transaction=True)
def test_the_threads_batch_on_sqlite_waits_while_the_broker_is_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[str | None] = []
    monkeypatch.setattr(
        award_points, "apply_async", lambda task_id=None, **kw: sent.append(task_id)
    )
    with override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE):
        rows = [publish_on_commit(award_points, message()) for _ in range(2)]
    monkeypatch.setattr(relay.failures.breaker, "paused", lambda: True)
    with CaptureQueriesContext(connection) as queries:
        assert _publish_unkeyed("default", [r.pk for r in rows]).published == 0
    assert sent == []
    assert queries.captured_queries == []
    assert set(OutboxMessage.objects.values_list("status", "claimed_until")) == {
        (OutboxStatus.PENDING, None)
    }


@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db
@pytest.mark.parametrize("in_the_publisher_thread", [True, False])
def test_the_publisher_thread_hands_the_gil_over_between_rows(
    monkeypatch: pytest.MonkeyPatch, in_the_publisher_thread: bool
) -> None:
    # A consumer in the same process whose answer came back gets the GIL after the
    # row being published, not after the whole batch; a relay does not pause.
    sent: list[str | None] = []
    monkeypatch.setattr(
        award_points, "apply_async", lambda task_id=None, **options: sent.append(task_id)
    )
    with override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE):
        rows = [publish_on_commit(award_points, message()) for _ in range(3)]
    pauses: list[float] = []
    monkeypatch.setattr(relay.time, "sleep", pauses.append)
    monkeypatch.setattr(sender._batch, "keep", in_the_publisher_thread, raising=False)
    try:
        assert _publish_unkeyed("default", [r.pk for r in rows]).published == 3
    finally:
        sender._release_kept()
    assert len(sent) == 3 or sent == []  # through apply_async or the batch's producer
    assert pauses == ([0, 0] if in_the_publisher_thread else [])


@pytest.mark.django_db(transaction=True)
def test_the_thread_keeps_a_keys_order_and_batches_what_comes_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[str] = []
    monkeypatch.setattr(award_points, "apply_async", lambda **kw: sent.append(kw["task_id"]))
    batches: list[int] = []
    unkeyed = _publish_unkeyed

    def counted(db: str, ids: list[int]) -> Any:
        batches.append(len(ids))
        return unkeyed(db, ids)

    monkeypatch.setattr("idempotent_orders.outbox.relay._publish_unkeyed", counted)
    with override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE):
        first = publish_on_commit(award_points, message(), order_key="k")
    second = publish_on_commit(award_points, message(), order_key="k")  # handed to the thread
    plain = [publish_on_commit(award_points, message()) for _ in range(10)]
    assert flush_publisher(timeout=30)
    assert second.message_id not in sent  # not before the first of its key
    assert status(second) == OutboxStatus.PENDING
    assert sorted(sent) == sorted(r.message_id for r in plain)
    assert sum(batches) == 10
    assert len(batches) < 10  # the ids that came together went together
    relay_outbox()
    assert sent[-2:] == [first.message_id, second.message_id]


@pytest.mark.services
@pytest.mark.django_db(transaction=True)
def test_looping_relay_wakes_on_notify_beats_and_stops_cleanly_on_sigterm(
    tmp_path: Path,
) -> None:
    postgres = connection.vendor == "postgresql"
    # On PostgreSQL it polls once an hour: only NOTIFY can wake it for the new row.
    interval = "3600" if postgres else "0.2"
    heartbeat, out = tmp_path / "alive", tmp_path / "relay.out"
    env = worker_env(broker_url="memory://", queue=f"relay-{uuid.uuid4().hex}")
    with out.open("wb") as handle:
        relay = subprocess.Popen(
            [
                *(sys.executable, "-u", "manage.py", "relay_outbox", "--loop"),
                *("--interval", interval, "--heartbeat-file", str(heartbeat)),
            ],
            cwd=ROOT,
            env={**env, "DJANGO_SETTINGS_MODULE": "tests.settings"},
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        assert wait_until(heartbeat.exists, timeout=60), out.read_text()
        beat = heartbeat.read_text()
        relay_only = override_settings(IDEMPOTENT_ORDERS={"OUTBOX_PUBLISH_ON_COMMIT": False})
        with relay_only, transaction.atomic():
            row = publish_on_commit(award_points, message())
        assert wait_until(lambda: status(row) == OutboxStatus.SENT, timeout=60), out.read_text()
        # It beats again after that run (the row is marked inside the run, the beat after it).
        assert wait_until(lambda: heartbeat.read_text() != beat, timeout=30), out.read_text()
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(60) == 0
    finally:
        stop_processes([relay])
    assert out.read_text().splitlines()[-1] == "stopped"
