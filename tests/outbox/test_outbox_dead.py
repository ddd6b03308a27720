"""Outbox dead letters: a row that cannot be published ends dead, visible and requeueable."""

from __future__ import annotations

import json
import uuid
from io import StringIO
from typing import Any

import pytest
from django.core.checks import run_checks
from django.core.management import CommandError, call_command
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from demo_project.tasks import award_points
from idempotent_orders.models import AuditEntry, OutboxMessage, OutboxStatus
from idempotent_orders.outbox import (
    PermanentPublishError,
    outbox_stats,
    publish_on_commit,
    relay_outbox,
    requeue_outbox,
)
from idempotent_orders.signals import outbox_dead
from tests.support.admin import requeue_refused_to_a_viewer, shown
from tests.support.metrics import sample

pytestmark = pytest.mark.django_db

NO_IMMEDIATE = {"OUTBOX_PUBLISH_ON_COMMIT": False}


def message() -> dict[str, Any]:
    return {"message_id": f"out-{uuid.uuid4().hex}", "customer": "erin", "points": 5}


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """award_points' publish: raises ``broker["error"]`` when set, else records the id."""
    state: dict[str, Any] = {"error": None, "sent": []}

    def apply_async(args: Any = None, task_id: str | None = None, **options: Any) -> None:
        if state["error"] is not None:
            raise state["error"]
        state["sent"].append(task_id)

    monkeypatch.setattr(award_points, "apply_async", apply_async)
    return state


@pytest.fixture
def dead_signals() -> Any:
    seen: list[dict[str, Any]] = []
    outbox_dead.connect(lambda **kw: seen.append(kw), weak=False, dispatch_uid="test-dead")
    yield seen
    outbox_dead.disconnect(dispatch_uid="test-dead")


def make_due(row: OutboxMessage) -> None:
    OutboxMessage.objects.filter(pk=row.pk).update(available_at=timezone.now())


@override_settings(IDEMPOTENT_ORDERS={**NO_IMMEDIATE, "OUTBOX_MAX_ATTEMPTS": 3})
def test_a_row_failing_max_attempts_times_ends_dead_with_its_last_error(
    broker: dict[str, Any], dead_signals: list[dict[str, Any]]
) -> None:
    row = publish_on_commit(award_points, message())
    other = publish_on_commit(award_points, message())
    results = []
    for attempt in range(3):
        broker["error"] = ValueError(f"refused #{attempt + 1}")
        make_due(row)
        results.append(relay_outbox(ids=[row.pk]))
    assert [(r.retried, r.dead) for r in results] == [(1, 0), (1, 0), (0, 1)]
    row.refresh_from_db()
    assert (row.status, row.attempts) == (OutboxStatus.DEAD, 3)
    assert row.last_error == "ValueError: refused #3"
    assert row.dead_at is not None
    assert dead_signals == [
        {
            "signal": outbox_dead,
            "sender": OutboxMessage,
            "message_id": row.message_id,
            "task_name": "demo_project.award_points",
            "attempts": 3,
            "error": "ValueError: refused #3",
        }
    ]
    # Never tried again: the relay leaves it, even when the broker is back.
    broker["error"] = None
    make_due(row)
    assert relay_outbox().published == 1  # the other row only
    assert broker["sent"] == [other.message_id]
    assert outbox_stats()["dead"] == 1


@override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE)
def test_a_permanent_error_dead_letters_at_once(
    broker: dict[str, Any], dead_signals: list[dict[str, Any]]
) -> None:
    row = publish_on_commit(award_points, message())
    broker["error"] = PermanentPublishError("payload refused by the schema registry")
    result = relay_outbox()
    assert (result.published, result.retried, result.dead) == (0, 0, 1)
    row.refresh_from_db()
    assert (row.status, row.attempts) == (OutboxStatus.DEAD, 1)
    assert "schema registry" in row.last_error
    assert len(dead_signals) == 1


def _dead_row(task_name: str = "demo_project.award_points") -> OutboxMessage:
    return OutboxMessage.objects.create(
        message_id=f"dead-{uuid.uuid4().hex}",
        task_name=task_name,
        payload=message(),
        status=OutboxStatus.DEAD,
        attempts=20,
        last_error="ConnectionError: broker down",
        dead_at=timezone.now(),
    )


def test_requeue_puts_only_dead_rows_back_and_keeps_the_error(broker: dict[str, Any]) -> None:
    dead, other_task = _dead_row(), _dead_row("demo_project.other")
    sent = OutboxMessage.objects.create(
        message_id="sent-1", task_name="demo_project.award_points", payload={}, status="sent"
    )
    assert requeue_outbox(message_ids=[dead.message_id, sent.message_id], dry_run=True) == 1
    assert OutboxMessage.objects.get(pk=dead.pk).status == OutboxStatus.DEAD
    assert requeue_outbox(message_ids=[dead.message_id, sent.message_id]) == 1
    dead.refresh_from_db()
    assert (dead.status, dead.attempts, dead.dead_at) == (OutboxStatus.PENDING, 0, None)
    assert dead.last_error == "ConnectionError: broker down"
    assert OutboxMessage.objects.get(pk=sent.pk).status == OutboxStatus.SENT
    assert OutboxMessage.objects.get(pk=other_task.pk).status == OutboxStatus.DEAD
    assert relay_outbox().published == 1
    assert broker["sent"] == [dead.message_id]


def test_requeue_command(broker: dict[str, Any]) -> None:
    a, b, c = _dead_row(), _dead_row(), _dead_row("demo_project.other")
    with pytest.raises(CommandError, match="--all"):
        call_command("requeue_outbox")
    out = StringIO()
    call_command("requeue_outbox", "--all", "--dry-run", stdout=out)
    assert out.getvalue().strip() == "would requeue=3"
    out = StringIO()
    call_command("requeue_outbox", "--message-id", a.message_id, stdout=out)
    assert out.getvalue().strip() == "requeued=1"
    out = StringIO()
    call_command("requeue_outbox", "--task", "demo_project.other", stdout=out)
    assert out.getvalue().strip() == "requeued=1"
    statuses = dict(OutboxMessage.objects.values_list("pk", "status"))
    assert statuses == {a.pk: "pending", b.pk: "dead", c.pk: "pending"}
    call_command("requeue_outbox", "--all", stdout=StringIO())
    assert outbox_stats()["dead"] == 0


def changelist() -> str:
    return reverse("admin:idempotent_orders_outboxmessage_changelist")


def test_admin_requeue_confirms_then_requeues_and_audits(staff: Client) -> None:
    dead, sent = _dead_row(), _dead_row()
    OutboxMessage.objects.filter(pk=sent.pk).update(status=OutboxStatus.SENT)
    client = staff
    selected = {"action": "requeue_dead", "_selected_action": [dead.pk, sent.pk]}

    page = client.post(changelist(), selected)
    assert page.status_code == 200
    assert "are you sure?" in page.content.decode()
    assert "nothing: not dead" in page.content.decode()
    assert OutboxMessage.objects.get(pk=dead.pk).status == OutboxStatus.DEAD  # not yet

    done = client.post(changelist(), {**selected, "post": "yes"}, follow=True)
    assert "Requeue: 1 requeued, 1 skipped." in shown(done)
    assert OutboxMessage.objects.get(pk=dead.pk).status == OutboxStatus.PENDING
    assert OutboxMessage.objects.get(pk=sent.pk).status == OutboxStatus.SENT
    entries = {(e.action, e.object_id, e.result, e.username) for e in AuditEntry.objects.all()}
    assert entries == {
        ("outbox:requeue", str(dead.pk), "requeued", "operator"),
        ("outbox:requeue", str(sent.pk), "skipped", "operator"),
    }
    detail = AuditEntry.objects.get(object_id=str(dead.pk)).detail
    assert detail == "dead after 20 attempt(s): ConnectionError: broker down; now pending"


def test_admin_requeue_needs_the_change_permission() -> None:
    dead = _dead_row()
    requeue_refused_to_a_viewer("view_outboxmessage", changelist(), dead.pk)
    assert OutboxMessage.objects.get(pk=dead.pk).status == OutboxStatus.DEAD
    assert not AuditEntry.objects.exists()


def test_admin_publish_again_leaves_dead_rows_to_the_requeue_action(staff: Client) -> None:
    dead = _dead_row()
    client = staff
    client.post(changelist(), {"action": "publish_again", "_selected_action": [dead.pk]})
    assert OutboxMessage.objects.get(pk=dead.pk).status == OutboxStatus.DEAD


def test_dead_rows_in_stats_command_dashboard_and_metrics(staff: Client) -> None:
    _dead_row()
    _dead_row()
    out = StringIO()
    call_command("idempotent_orders_stats", "--json", stdout=out)
    counts = json.loads(out.getvalue())
    assert (counts["outbox:dead"], counts["outbox:pending"]) == (2, 0)
    text = Client().get("/metrics").content.decode()
    assert sample(text, "idempotent_orders_outbox_dead") == 2
    assert sample(text, "idempotent_orders_outbox_pending") == 0
    assert "idempotent_orders_outbox_oldest_pending_seconds 0.0" in text

    client = staff
    html = client.get(reverse("admin:app_list", args=["idempotent_orders"])).content.decode()
    assert 'id="attention-outbox_dead"' in html


def test_max_attempts_below_one_is_an_error() -> None:
    with override_settings(IDEMPOTENT_ORDERS={"OUTBOX_MAX_ATTEMPTS": 0}):
        assert "idempotent_orders.E036" in [m.id for m in run_checks()]


@override_settings(IDEMPOTENT_ORDERS={**NO_IMMEDIATE, "OUTBOX_MAX_ATTEMPTS": 2})
def test_a_broker_outage_pauses_the_relay_and_spends_no_dead_letter_budget(
    broker: dict[str, Any], dead_signals: list[dict[str, Any]], caplog: Any
) -> None:
    from idempotent_orders.outbox import breaker

    rows = [publish_on_commit(award_points, message()) for _ in range(3)]
    broker["error"] = ConnectionRefusedError(111, "Connection refused")
    for _ in range(5):  # far past OUTBOX_MAX_ATTEMPTS
        for row in rows:
            make_due(row)
        breaker.open_until = 0.0  # the pause is over: the next run probes the broker
        result = relay_outbox()
        assert (result.published, result.dead) == (0, 0)
        assert result.retried == 1  # the first row tripped the breaker; the rest waited
        assert breaker.paused()
        assert relay_outbox().retried == 0  # paused: nothing is tried
    for row in rows:
        row.refresh_from_db()
        assert (row.status, row.attempts) == (OutboxStatus.PENDING, 0)
    assert dead_signals == []
    assert rows[0].last_error.startswith("broker unreachable: ConnectionRefusedError")
    said = [r.getMessage() for r in caplog.records if "broker is unreachable" in r.getMessage()]
    assert len(said) == 1  # once per outage, not once per row or run

    broker["error"] = None  # the broker is back
    for row in rows:
        make_due(row)
    breaker.open_until = 0.0
    assert relay_outbox().published == 3
    assert not breaker.paused()
    assert breaker.failures == 0
    assert sorted(broker["sent"]) == sorted(r.message_id for r in rows)


def test_stats_count_each_status_and_the_dashboard_never_counts_every_sent_row(
    staff: Client,
) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    _dead_row()
    for i, status in enumerate(["sent", "sent", "pending"]):
        OutboxMessage.objects.create(
            message_id=f"stats-{i}",
            task_name="demo_project.award_points",
            payload={},
            status=status,
        )
    full = outbox_stats()
    assert (full["pending"], full["sent"], full["dead"]) == (1, 2, 1)
    lean = outbox_stats(sent=False)
    assert (lean["pending"], lean["sent"], lean["dead"]) == (1, None, 1)
    with CaptureQueriesContext(connection) as queries:
        assert staff.get("/admin/").status_code == 200
    outbox = [
        q["sql"].upper() for q in queries if "IDEMPOTENT_ORDERS_OUTBOXMESSAGE" in q["sql"].upper()
    ]
    assert outbox, "the dashboard shows the outbox"
    # Every count it makes of the outbox is filtered (served by a partial index).
    assert all(" WHERE " in sql for sql in outbox), outbox
