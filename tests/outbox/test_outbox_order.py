"""Per-key order: a row is not published while an earlier row of its key is pending or dead."""

from __future__ import annotations

import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings
from django.utils import timezone

from demo_project.tasks import award_points
from idempotent_orders.models import OutboxMessage, OutboxStatus
from idempotent_orders.outbox import publish_on_commit, relay_outbox, requeue_outbox
from tests.support.outbox import publishes, run_relays
from tests.support.services import kill_group, stop_processes, wait_until

NO_IMMEDIATE = {"OUTBOX_PUBLISH_ON_COMMIT": False}


def message() -> dict[str, Any]:
    return {"message_id": f"out-{uuid.uuid4().hex}", "customer": "erin", "points": 5}


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """award_points' publish: fails for the ids in ``broker["down_for"]``, records the rest."""
    state: dict[str, Any] = {"down_for": set(), "sent": []}

    def apply_async(args: Any = None, task_id: str | None = None, **options: Any) -> None:
        if task_id in state["down_for"]:
            raise ValueError("the broker refused this message")
        state["sent"].append(task_id)

    monkeypatch.setattr(award_points, "apply_async", apply_async)
    return state


def due_now() -> None:
    OutboxMessage.objects.update(available_at=timezone.now())


@pytest.mark.django_db
@override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE)
def test_a_key_waits_for_its_earlier_row_others_do_not(broker: dict[str, Any]) -> None:
    a1, a2, a3 = (publish_on_commit(award_points, message(), order_key="order-1") for _ in "123")
    b1 = publish_on_commit(award_points, message(), order_key="order-2")
    free = publish_on_commit(award_points, message())
    broker["down_for"] = {a1.message_id}
    result = relay_outbox()
    assert (result.published, result.retried) == (2, 1)
    assert broker["sent"] == [b1.message_id, free.message_id]  # a2 and a3 wait behind a1

    broker["down_for"] = set()
    due_now()
    assert relay_outbox(batch_size=100).published == 3
    assert broker["sent"][2:] == [a1.message_id, a2.message_id, a3.message_id]


@pytest.mark.django_db
@override_settings(IDEMPOTENT_ORDERS={**NO_IMMEDIATE, "OUTBOX_MAX_ATTEMPTS": 1})
def test_a_dead_row_holds_its_key_until_requeued(broker: dict[str, Any]) -> None:
    first, second = (publish_on_commit(award_points, message(), order_key=7) for _ in "12")
    assert first.order_key == "7"
    broker["down_for"] = {first.message_id}
    assert relay_outbox().dead == 1
    due_now()
    assert relay_outbox().published == 0  # second waits behind the dead first
    assert OutboxMessage.objects.get(pk=second.pk).status == OutboxStatus.PENDING

    broker["down_for"] = set()
    assert requeue_outbox(ids=[first.pk]) == 1
    assert relay_outbox().published == 2
    assert broker["sent"] == [first.message_id, second.message_id]


@pytest.mark.django_db
def test_publish_after_commit_leaves_a_held_back_row_to_the_relay(
    broker: dict[str, Any], django_capture_on_commit_callbacks: Any
) -> None:
    with override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE):
        first = publish_on_commit(award_points, message(), order_key="k")
    with django_capture_on_commit_callbacks(execute=True):
        second = publish_on_commit(award_points, message(), order_key="k")
    assert broker["sent"] == []  # not before the first
    assert OutboxMessage.objects.get(pk=second.pk).status == OutboxStatus.PENDING
    relay_outbox()
    assert broker["sent"] == [first.message_id, second.message_id]


@pytest.mark.django_db
@override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE)
def test_lease_fallback_keeps_key_order(
    broker: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.db import connection

    monkeypatch.setattr(connection.features, "has_select_for_update_skip_locked", False)
    rows = [publish_on_commit(award_points, message(), order_key="k") for _ in range(4)]
    broker["down_for"] = {rows[1].message_id}
    relay_outbox()
    assert broker["sent"] == [rows[0].message_id]
    assert OutboxMessage.objects.filter(claimed_until__isnull=False).count() == 0
    broker["down_for"] = set()
    due_now()
    relay_outbox()
    assert broker["sent"] == [r.message_id for r in rows]


def assert_in_key_order(seen: list[str], keys: dict[str, list[str]]) -> None:
    """For each key, its publishes in log order never go back to an earlier row."""
    position = {mid: i for rows in keys.values() for i, mid in enumerate(rows)}
    key_of = {mid: key for key, rows in keys.items() for mid in rows}
    last: dict[str, int] = defaultdict(lambda: -1)
    for mid in seen:
        key = key_of[mid]
        assert position[mid] >= last[key], (key, mid, seen)
        last[key] = position[mid]


@pytest.mark.races
@pytest.mark.services
@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db(transaction=True)
def test_three_parallel_relays_and_a_killed_one_keep_each_keys_order(tmp_path: Path) -> None:
    keys: dict[str, list[str]] = defaultdict(list)
    with override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE):
        for n in range(240):  # 40 keys, 6 rows each, interleaved as producers would
            key = f"order-{n % 40}"
            keys[key].append(publish_on_commit(award_points, message(), order_key=key).message_id)
    relays, log, marker = run_relays(tmp_path, 3, batch=8, stall_after=5)
    try:
        assert wait_until(marker.exists, timeout=60)
        kill_group(relays[0])  # published 5 of its batch, marked none
        for relay in relays[1:]:
            assert relay.wait(120) == 0
        # The killed relay's locks died with it: a fresh relay finishes its rows.
        restarted, _, _ = run_relays(tmp_path, 1, batch=8)
        assert restarted[0].wait(120) == 0
    finally:
        stop_processes(relays)
    seen = [mid for _, mid in publishes(log)]
    assert set(seen) == {mid for rows in keys.values() for mid in rows}
    assert len(seen) - len(set(seen)) <= 5  # only the killed relay's unmarked publishes again
    assert_in_key_order(seen, keys)
    # The killed relay, the restarted one and at least one of the two others published.
    assert len({pid for pid, _ in publishes(log)}) >= 3
    assert not OutboxMessage.objects.exclude(status=OutboxStatus.SENT).exists()
