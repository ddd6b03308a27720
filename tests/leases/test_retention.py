"""Retention purge: old rows go in batches; processing, failed and still-parked rows stay."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from idempotent_orders import leases
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import (
    InboxStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
    Timer,
    TimerStatus,
    WebhookEvent,
    WebhookStatus,
)
from idempotent_orders.retention import purge
from idempotent_orders.timers import fire_due, schedule
from idempotent_orders.webhooks.ingress import REUSED
from tests.support.messages import payment

pytestmark = pytest.mark.django_db


def age(days: float, **filters) -> None:
    then = timezone.now() - timedelta(days=days)
    ProcessedMessage.objects.filter(**filters).update(created_at=then, updated_at=then)


def test_purge_deletes_old_final_rows_in_batches_and_keeps_the_rest(make_order) -> None:
    orders = [make_order() for _ in range(5)]
    for order in orders:
        consume_message(payment(order), consumer="payments")
    consume_message({"message_id": "junk", "type": "nope"}, consumer="payments")
    processing = leases.claim(consumer="effects", message_id="in-flight", token=0).lease
    assert processing is not None
    failing = leases.claim(consumer="effects", message_id="failed", token=0).lease
    assert failing is not None
    leases.fail(failing.pk, reason="operator")
    fresh = make_order()
    consume_message(payment(fresh, message_id="fresh"), consumer="payments")
    age(
        30,
        message_id__in=[
            *ProcessedMessage.objects.exclude(message_id="fresh").values_list(
                "message_id", flat=True
            )
        ],
    )

    report = purge(batch_size=2)
    assert report.inbox == 6  # five payments and the rejected junk
    left = set(ProcessedMessage.objects.values_list("message_id", flat=True))
    assert left == {"in-flight", "failed", "fresh"}
    assert purge().inbox == 0


def test_parked_leftovers_are_given_up_with_a_reason_not_lost(make_order) -> None:
    order = make_order()
    assert consume_message(payment(order, seq=3, message_id="early"), consumer="payments") == (
        Outcome.PARKED
    )
    ParkedMessage.objects.update(parked_at=timezone.now() - timedelta(days=60))
    age(60, message_id="early")
    report = purge()
    assert (report.parked, report.inbox) == (1, 0)  # the row stays, now explained
    assert not ParkedMessage.objects.exists()
    row = ProcessedMessage.objects.get(message_id="early")
    assert (row.status, row.outcome) == (InboxStatus.REJECTED, Outcome.REJECTED)
    assert "gave up waiting" in row.error
    assert "waiting for seq 1" in row.error
    # It is kept a full window from the moment it was given up.
    assert purge().inbox == 0
    assert purge(now=timezone.now() + timedelta(days=8)).inbox == 1


def test_young_parked_messages_stay(make_order) -> None:
    order = make_order()
    consume_message(payment(order, seq=2, message_id="early"), consumer="payments")
    age(30, message_id="early")  # older than DEDUP_RETENTION, but still parked
    assert purge().as_dict() == {"inbox": 0, "parked": 0, "keys": 0, "webhooks": 0, "timers": 0}
    assert ParkedMessage.objects.count() == 1


def test_command(make_order, capsys) -> None:
    consume_message(payment(make_order()), consumer="payments")
    age(30)
    call_command("purge_idempotent_orders", "--batch-size", "10")
    assert "inbox=1" in capsys.readouterr().out


def _event(kind: str, days: float, **fields) -> WebhookEvent:
    then = timezone.now() - timedelta(days=days)
    row = WebhookEvent.objects.create(provider="fakepay", claimed_id=kind, **fields)
    WebhookEvent.objects.filter(pk=row.pk).update(received_at=then, last_delivery_at=then)
    return row


def test_webhook_events_join_the_purge_with_their_own_windows(make_order) -> None:
    processed = WebhookStatus.PROCESSED
    rejected = WebhookStatus.REJECTED
    _event("old-processed", 31, event_id="evt_1", status=processed)
    _event("young-processed", 29, event_id="evt_2", status=processed)
    _event("old-refused", 8, status=rejected, error="webhook-signature-invalid: no")
    _event("young-refused", 6, status=rejected, error="webhook-signature-invalid: no")
    # A signed event reusing another's id: a payment to look at, kept as long as events.
    _event("flagged", 8, status=rejected, error=f"{REUSED}: first event stands")
    _event("old-flagged", 31, status=rejected, error=f"{REUSED}: first event stands")
    # Not consumed yet: kept, however old.
    _event("failed", 90, event_id="evt_3", status=WebhookStatus.FAILED)
    _event("received", 90, event_id="evt_4", status=WebhookStatus.RECEIVED)
    # Delivered again lately: its window starts again.
    retried = _event("retried", 31, event_id="evt_5", status=processed)
    WebhookEvent.objects.filter(pk=retried.pk).update(last_delivery_at=timezone.now())

    report = purge(batch_size=2)
    assert report.webhooks == 3
    left = set(WebhookEvent.objects.values_list("claimed_id", flat=True))
    assert left == {"young-processed", "young-refused", "flagged", "failed", "received", "retried"}


def test_fired_timers_join_the_purge_pending_ones_stay(make_order) -> None:
    now = timezone.now()
    fired = schedule(make_order(), "expire", at=now - timedelta(days=40))
    fire_due(now=now - timedelta(days=31))
    young = schedule(make_order(), "expire", at=now - timedelta(days=10))
    fire_due(now=now)
    Timer.objects.filter(pk=fired.pk).update(fired_at=now - timedelta(days=31))
    pending = schedule(make_order(), "expire", at=now - timedelta(days=60))
    assert set(Timer.objects.values_list("status", flat=True)) == {
        TimerStatus.FIRED,
        TimerStatus.PENDING,
    }
    report = purge()
    assert report.timers == 1
    assert set(Timer.objects.values_list("pk", flat=True)) == {young.pk, pending.pk}


def test_the_command_reports_webhook_events_and_timers(capsys) -> None:
    _event("old-refused", 8, status=WebhookStatus.REJECTED, error="webhook-body-invalid: x")
    call_command("purge_idempotent_orders")
    assert "webhooks=1, timers=0" in capsys.readouterr().out
