"""The relay's cost and its scaling: one UPDATE per batch, no backlog COUNT, N relays at once."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from demo_project.tasks import award_points
from idempotent_orders.models import OutboxMessage, OutboxStatus
from idempotent_orders.outbox import publish_on_commit, relay_outbox
from tests.support.outbox import publishes, run_relays
from tests.support.services import stop_processes

NO_IMMEDIATE = {"OUTBOX_PUBLISH_ON_COMMIT": False}


def message() -> dict[str, Any]:
    return {"message_id": f"out-{uuid.uuid4().hex}", "customer": "erin", "points": 5}


@pytest.mark.django_db
@override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE)
def test_a_batch_is_marked_sent_by_one_update_and_the_backlog_is_not_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(award_points, "apply_async", lambda **kw: calls.append(kw["task_id"]))
    for _ in range(10):
        publish_on_commit(award_points, message())
    with CaptureQueriesContext(connection) as queries:
        result = relay_outbox(batch_size=10)
    assert (result.published, result.pending) == (10, 0)
    statements = [q["sql"].lstrip().upper() for q in queries.captured_queries]
    updates = [sql for sql in statements if sql.startswith("UPDATE")]
    assert len([sql for sql in updates if "'SENT'" in sql]) == 1, updates
    if connection.features.has_select_for_update_skip_locked:
        assert len(updates) == 1, updates  # elsewhere each row is claimed first (a lease)
    assert not [sql for sql in statements if "COUNT(" in sql]
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == 10
    assert len(calls) == 10


@pytest.mark.django_db
@override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE)
def test_pending_counts_the_rows_this_run_left_pending(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [publish_on_commit(award_points, message()) for _ in range(3)]

    def fail_the_first(task_id: str | None = None, **kwargs: Any) -> None:
        if task_id == rows[0].message_id:
            raise ValueError("the broker refused this message")

    monkeypatch.setattr(award_points, "apply_async", fail_the_first)
    result = relay_outbox()
    assert (result.published, result.retried, result.pending) == (2, 1, 1)


@pytest.mark.races
@pytest.mark.services
@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db(transaction=True)
def test_three_relays_in_parallel_publish_each_id_exactly_once(tmp_path: Path) -> None:
    rows = 300
    with override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE):
        ids = [publish_on_commit(award_points, message()).message_id for _ in range(rows)]
    relays, log, _ = run_relays(tmp_path, 3)
    try:
        for relay in relays:
            assert relay.wait(120) == 0
    finally:
        stop_processes(relays)
    seen = publishes(log)
    per_id = Counter(mid for _, mid in seen)
    assert set(per_id) == set(ids)
    assert [mid for mid, n in per_id.items() if n != 1] == []  # each id exactly once
    # The three really ran side by side: each published part of the rows.
    assert len({pid for pid, _ in seen}) == 3
    assert not OutboxMessage.objects.filter(status=OutboxStatus.PENDING).exists()


@pytest.mark.django_db
@override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE)
def test_a_batch_publishes_through_one_producer_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real publishes (in-memory broker): one checkout of the producer pool per batch."""
    from celery import current_app

    pool = current_app.producer_pool
    checkouts: list[int] = []
    acquire = pool.acquire

    def counting(*args: Any, **kwargs: Any) -> Any:
        checkouts.append(1)
        return acquire(*args, **kwargs)

    monkeypatch.setattr(pool, "acquire", counting)
    for _ in range(5):
        publish_on_commit(award_points, message())
    assert relay_outbox(batch_size=10).published == 5
    assert len(checkouts) == 1


@pytest.mark.backends("sqlite")
@pytest.mark.django_db(transaction=True)
@override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE)
def test_sqlite_claims_a_leased_batch_in_one_statement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # SQLite has one write lock: a consumer committing meanwhile waits for it once per
    # batch, not once per row; and the batch's claims cost one statement, not five.
    monkeypatch.setattr(award_points, "apply_async", lambda **kw: None)
    for _ in range(5):
        publish_on_commit(award_points, message())
    with CaptureQueriesContext(connection) as queries:
        assert relay_outbox(batch_size=5).published == 5
    sql = [q["sql"].lstrip().upper() for q in queries.captured_queries]
    # The claim, and the batch's mark (one UPDATE, after the publishes).
    updates = [s for s in sql if s.startswith("UPDATE")]
    assert len(updates) == 2, sql
    assert 'CLAIMED_UNTIL" = ' in updates[0], sql
    assert "RETURNING" in updates[0], sql
    assert not [s for s in sql if s.startswith("BEGIN")], sql
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == 5


@pytest.mark.backends("sqlite")
@pytest.mark.django_db(transaction=True)
@override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE)
def test_sqlite_batch_claim_leaves_a_row_another_relay_leased_after_the_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from idempotent_orders.outbox import relay

    calls: list[str] = []
    monkeypatch.setattr(award_points, "apply_async", lambda **kw: calls.append(kw["task_id"]))
    rows = [publish_on_commit(award_points, message()) for _ in range(3)]
    claim = relay._claim_at_once

    def raced(db: str, ids: list[int], until: Any) -> Any:
        # Another relay leases the first row between this relay's read and its claim.
        later = timezone.now() + timedelta(seconds=60)
        OutboxMessage.objects.filter(pk=rows[0].pk).update(claimed_until=later)
        return claim(db, ids, until)

    monkeypatch.setattr(relay, "_claim_at_once", raced)
    assert relay_outbox(batch_size=5).published == 2
    assert sorted(calls) == sorted(r.message_id for r in rows[1:])
    first = OutboxMessage.objects.get(pk=rows[0].pk)
    assert first.status == OutboxStatus.PENDING
