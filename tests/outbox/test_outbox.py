"""Transactional outbox: rows commit with the producer, the relay publishes each id once."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.sites import site
from django.core.checks import run_checks
from django.core.management import call_command
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from demo_project.models import LoyaltyAccount
from demo_project.shop import place_order
from demo_project.tasks import award_points
from idempotent_orders.models import OutboxMessage, OutboxStatus, ProcessedMessage
from idempotent_orders.outbox import (
    breaker,
    flush_publisher,
    outbox_stats,
    publish_on_commit,
    purge_outbox,
    relay_outbox,
)
from idempotent_orders.signals import outbox_relayed
from tests.support.services import ROOT, kill_group, wait_until

pytestmark = pytest.mark.django_db


def OrderModel() -> Any:
    from idempotent_orders import get_order_model

    return get_order_model()._default_manager


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Record publishes of award_points instead of sending them to a broker."""
    calls: list[tuple[Any, ...]] = []

    def apply_async(args: Any = None, task_id: str | None = None, **options: Any) -> None:
        calls.append((task_id, args[0], options))

    monkeypatch.setattr(award_points, "apply_async", apply_async)
    return calls


def message(**extra: Any) -> dict[str, Any]:
    return {"message_id": f"out-{uuid.uuid4().hex}", "customer": "erin", "points": 5, **extra}


def test_nothing_is_written_or_sent_when_the_producer_rolls_back(
    sent: list[Any], django_capture_on_commit_callbacks: Any
) -> None:
    def produce() -> None:
        with transaction.atomic():
            publish_on_commit(award_points, message())
            raise ValueError("the producer's own write failed")

    with (
        django_capture_on_commit_callbacks(execute=True),
        pytest.raises(ValueError, match="failed"),
    ):
        produce()
    assert OutboxMessage.objects.count() == 0
    assert sent == []


def test_published_after_commit_with_task_id_equal_to_message_id(
    sent: list[Any], django_capture_on_commit_callbacks: Any
) -> None:
    msg = message()
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        row = publish_on_commit(award_points, msg, queue="points")
        assert sent == []  # never before commit
    assert len(callbacks) == 1
    assert sent == [(msg["message_id"], msg, {"queue": "points"})]
    row.refresh_from_db()
    assert (row.status, row.message_id, row.task_name) == (
        OutboxStatus.SENT,
        msg["message_id"],
        "demo_project.award_points",
    )
    assert relay_outbox().published == 0  # nothing left for the relay


@override_settings(IDEMPOTENT_ORDERS={"OUTBOX_PUBLISH_ON_COMMIT": False})
def test_relay_publishes_pending_rows_in_batches_and_counts(sent: list[Any]) -> None:
    ids = [publish_on_commit("demo_project.award_points", message()).message_id for _ in range(5)]
    no_id = publish_on_commit(award_points, ["not", "a", "mapping"])
    assert len(no_id.message_id) == 32  # a generated id, fixed from now on
    assert outbox_stats()["pending"] == 6
    seen: list[dict[str, Any]] = []
    outbox_relayed.connect(lambda **kw: seen.append(kw), weak=False, dispatch_uid="t")
    try:
        result = relay_outbox(batch_size=2)
    finally:
        outbox_relayed.disconnect(dispatch_uid="t")
    assert (result.published, result.retried, result.pending) == (6, 0, 0)
    assert [c[0] for c in sent] == [*ids, no_id.message_id]
    assert seen[0]["published"] == 6
    assert outbox_stats()["sent"] == 6


@override_settings(IDEMPOTENT_ORDERS={"OUTBOX_PUBLISH_ON_COMMIT": False})
def test_a_failed_publish_is_retried_later(monkeypatch: pytest.MonkeyPatch) -> None:
    row = publish_on_commit(award_points, message())

    def broker_down(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker down")

    monkeypatch.setattr(award_points, "apply_async", broker_down)
    result = relay_outbox()
    assert (result.published, result.retried, result.pending) == (0, 1, 1)
    row.refresh_from_db()
    # The broker away is not the row's fault: its dead-letter budget is untouched.
    assert (row.status, row.attempts) == (OutboxStatus.PENDING, 0)
    assert row.last_error == "broker unreachable: ConnectionError: broker down"
    assert "broker down" in row.last_error
    assert row.available_at > timezone.now()
    assert relay_outbox().retried == 0  # backing off: not due yet
    assert outbox_stats()["retried"] == 0  # no failure of its own
    assert outbox_stats()["broker_paused"] is True

    monkeypatch.undo()
    calls: list[str | None] = []
    monkeypatch.setattr(award_points, "apply_async", lambda **kw: calls.append(kw["task_id"]))
    OutboxMessage.objects.filter(pk=row.pk).update(available_at=timezone.now())
    assert relay_outbox().published == 0  # still paused
    breaker.open_until = 0.0  # the pause is over
    assert relay_outbox().published == 1
    assert calls == [row.message_id]


@override_settings(IDEMPOTENT_ORDERS={"OUTBOX_PUBLISH_ON_COMMIT": False})
def test_lease_fallback_claims_each_row_once(
    sent: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [publish_on_commit(award_points, message()) for _ in range(3)]
    monkeypatch.setattr(connection.features, "has_select_for_update_skip_locked", False)
    # Another relay holds a live lease on the first row: it is left to that relay.
    later = timezone.now() + timezone.timedelta(seconds=60)
    OutboxMessage.objects.filter(pk=rows[0].pk).update(claimed_until=later)
    assert relay_outbox().published == 2
    # The lease ran out (the other relay died): the row is published.
    OutboxMessage.objects.filter(pk=rows[0].pk).update(claimed_until=timezone.now())
    assert relay_outbox().published == 1
    assert sorted(c[0] for c in sent) == sorted(r.message_id for r in rows)


def test_purge_deletes_only_old_sent_rows(sent: list[Any]) -> None:
    with override_settings(IDEMPOTENT_ORDERS={"OUTBOX_PUBLISH_ON_COMMIT": False}):
        old, new, pending = (publish_on_commit(award_points, message()) for _ in range(3))
    OutboxMessage.objects.filter(pk__in=[old.pk, new.pk]).update(
        status=OutboxStatus.SENT, sent_at=timezone.now()
    )
    OutboxMessage.objects.filter(pk=old.pk).update(
        sent_at=timezone.now() - timezone.timedelta(days=30)
    )
    assert purge_outbox() == 1
    assert set(OutboxMessage.objects.values_list("pk", flat=True)) == {new.pk, pending.pk}
    out = StringIO()
    call_command("purge_outbox", "--older-than", "0", stdout=out)
    assert "deleted=1 pending=1 sent=0 dead=0" in out.getvalue()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("earlier", ["committed", "same-transaction"])
def test_a_repeated_message_id_returns_the_existing_row_and_the_transaction_survives(
    sent: list[Any], make_order: Any, earlier: str
) -> None:
    # It raised IntegrityError inside the caller's transaction, which PostgreSQL
    # then aborted: the caller's own writes could not go on.
    msg = message()
    if earlier == "committed":
        first = publish_on_commit(award_points, msg)
    with transaction.atomic():
        if earlier == "same-transaction":
            first = publish_on_commit(award_points, msg)
        order = make_order()
        again = publish_on_commit(award_points, {**msg, "points": 99}, queue="other")
        # The caller's transaction is still usable after the repeat.
        make_order()
        assert OrderModel().filter(pk=order.pk).exists()
    assert again.pk == first.pk
    assert again.payload == msg  # the row as first written: the repeat changes nothing
    assert OutboxMessage.objects.filter(message_id=msg["message_id"]).count() == 1
    assert OrderModel().count() == 2
    flush_publisher(timeout=30)
    assert [call[0] for call in sent] == [msg["message_id"]]


@override_settings(IDEMPOTENT_ORDERS={"OUTBOX_PUBLISH_ON_COMMIT": False})
def test_relay_command(sent: list[Any]) -> None:
    publish_on_commit(award_points, message())
    out = StringIO()
    call_command("relay_outbox", stdout=out)
    assert out.getvalue().strip() == "published=1 retried=0 pending=0 dead=0"


def test_admin_actions(
    sent: list[Any], rf: Any, admin_user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with override_settings(IDEMPOTENT_ORDERS={"OUTBOX_PUBLISH_ON_COMMIT": False}):
        a, b = (
            publish_on_commit(award_points, message()),
            publish_on_commit(award_points, message()),
        )
    relay_outbox()
    model_admin = site._registry[OutboxMessage]
    request = rf.post("/")
    request.user = admin_user
    monkeypatch.setattr(model_admin, "message_user", lambda *args, **kwargs: None)
    model_admin.publish_again(request, OutboxMessage.objects.filter(pk=a.pk))
    assert OutboxMessage.objects.get(pk=a.pk).status == OutboxStatus.PENDING
    assert OutboxMessage.objects.get(pk=b.pk).status == OutboxStatus.SENT


def test_demo_order_creation_publishes_its_follow_up_through_the_outbox(
    sent: list[Any], django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        order = place_order(
            business_key=f"demo-{uuid.uuid4().hex}",
            customer="frank",
            amount=Decimal("42.90"),
            currency="CNY",
        )
    assert sent == [
        (
            f"order-points-{order.pk}",
            {"message_id": f"order-points-{order.pk}", "customer": "frank", "points": 42},
            {},
        )
    ]


@pytest.mark.parametrize(
    ("value", "check_id"),
    [
        ({"LOCK_CACHE": "nope"}, "idempotent_orders.E080"),
        ({"OUTBOX_BATCH_SIZE": 0}, "idempotent_orders.E036"),
        ({"OUTBOX_RETENTION": -1}, "idempotent_orders.E036"),
    ],
)
def test_checks(value: dict[str, Any], check_id: str) -> None:
    with override_settings(IDEMPOTENT_ORDERS=value):
        assert check_id in [m.id for m in run_checks()]
    assert not [m for m in run_checks() if m.id and m.id.startswith("idempotent_orders.E08")]


@pytest.mark.services
@pytest.mark.workers
@pytest.mark.backends("postgresql")
@override_settings(IDEMPOTENT_ORDERS={"OUTBOX_PUBLISH_ON_COMMIT": False})
def test_killed_relay_loses_nothing_and_consumers_apply_each_id_once(
    celery_workers: Any, tmp_path: Path
) -> None:
    workers = celery_workers("redis", processes=1, concurrency=2)
    rows = 20
    with transaction.atomic():
        ids = [
            publish_on_commit(award_points, message(customer="grace", points=1)).message_id
            for _ in range(rows)
        ]

    # The relay publishes 5 rows of its batch, then stalls before marking them; kill it there.
    marker = tmp_path / "stalled"
    relay = subprocess.Popen(
        [sys.executable, "-m", "tests.support.outbox_crash_relay", "5", str(marker)],
        cwd=ROOT,
        env=workers.env,
        start_new_session=True,
    )
    try:
        assert wait_until(marker.exists, timeout=60)
    finally:
        kill_group(relay)
    # The 5 were published, yet every row is still pending: the mark died with the relay.
    assert OutboxMessage.objects.filter(status=OutboxStatus.PENDING).count() == rows
    assert wait_until(lambda: points("grace") == 5, timeout=60), workers.log_tail()

    # Restart the relay: everything is published (5 of them for the second time).
    restarted = subprocess.Popen(
        [sys.executable, "manage.py", "relay_outbox", "--loop", "--interval", "0.2"],
        cwd=ROOT,
        env=workers.env,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert wait_until(
            lambda: not OutboxMessage.objects.filter(status=OutboxStatus.PENDING).exists(),
            timeout=60,
        )
    finally:
        kill_group(restarted, signal.SIGTERM)

    def deliveries() -> int:
        return sum(log.read_text(errors="replace").count("succeeded") for log in workers.logs)

    # Consumers saw 25 deliveries (each id at least once) and applied each id once.
    assert wait_until(lambda: deliveries() >= rows + 5, timeout=60), workers.log_tail()
    assert points("grace") == rows
    applied = ProcessedMessage.objects.filter(consumer="loyalty", message_id__in=ids)
    assert applied.count() == rows


def points(customer: str) -> int:
    row = LoyaltyAccount.objects.filter(customer=customer).first()
    return row.points if row else 0
