"""@idempotent(external=True): a leased call to another system, finished by the reconciler."""

from __future__ import annotations

import inspect
import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone

from demo_project import webhooks
from demo_project.models import WebhookDelivery
from demo_project.tasks import notify_partner
from idempotent_orders import leases, reconcile
from idempotent_orders.exceptions import CallFailed, CallInProgress
from idempotent_orders.idempotent import idempotent, load_step
from idempotent_orders.models import InboxStatus, Outcome, ProcessedMessage

pytestmark = pytest.mark.django_db(transaction=True)


def event(**extra: Any) -> dict[str, Any]:
    return {"message_id": f"evt-{uuid.uuid4().hex}", "data": {"order": 7}, **extra}


def row(message_id: str) -> ProcessedMessage:
    return ProcessedMessage.objects.get(consumer="partner-webhook", message_id=message_id)


def expire(message_id: str) -> None:
    ProcessedMessage.objects.filter(message_id=message_id).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )


def test_one_call_one_effect_and_a_duplicate_returns_the_recorded_result() -> None:
    msg = event()
    assert notify_partner(msg) == {"notified": msg["message_id"]}
    assert notify_partner(msg) == {"notified": msg["message_id"]}
    assert webhooks.effects(msg["message_id"]) == 1
    inbox = row(msg["message_id"])
    assert (inbox.status, inbox.outcome, inbox.lease_expires_at) == (
        InboxStatus.DONE,
        Outcome.APPLIED,
        None,
    )
    # The partner got the lease's key: stable per (consumer, message id), not the id itself.
    sent = WebhookDelivery.objects.get(ref=msg["message_id"])
    assert sent.idempotency_key == leases.idempotency_key("partner-webhook", msg["message_id"])


def test_a_failed_call_raises_and_the_reconciler_retries_it_once_after_verifying() -> None:
    msg = event()
    webhooks.script(msg["message_id"], "fail")
    with pytest.raises(webhooks.WebhookError):
        notify_partner(msg)
    assert row(msg["message_id"]).status == InboxStatus.PROCESSING
    # A redelivery does not retry on its own: only the reconciler, which verifies, does.
    with pytest.raises(CallInProgress):
        notify_partner(msg)
    assert reconcile.reconcile().actions == {"completed": 1}
    assert reconcile.reconcile().actions == {}
    assert webhooks.effects(msg["message_id"]) == 1
    assert WebhookDelivery.objects.filter(ref=msg["message_id"]).count() == 2
    # The replayed call's result is recorded; the next delivery returns it.
    assert notify_partner(msg) == {"notified": msg["message_id"]}


def test_an_effect_the_verifier_confirms_is_completed_without_calling_again() -> None:
    msg = event()
    leases.claim(
        consumer="partner-webhook",
        message_id=msg["message_id"],
        token=0,
        body=json.dumps(
            {"module": "demo_project.tasks", "task": notify_partner.name, "args": [msg]}
            | {"kwargs": {}}
        ),
    )
    webhooks.post(
        msg["message_id"],
        msg["data"],
        idempotency_key=leases.idempotency_key("partner-webhook", msg["message_id"]),
    )  # the worker reached the partner, then died
    expire(msg["message_id"])
    assert reconcile.reconcile().actions == {"completed": 1}
    assert WebhookDelivery.objects.filter(ref=msg["message_id"]).count() == 1
    inbox = row(msg["message_id"])
    assert (inbox.status, inbox.result) == (InboxStatus.DONE, None)


def test_without_a_verifier_an_interrupted_call_is_never_repeated_and_ends_failed(
    settings: Any,
) -> None:
    calls: list[str] = []

    @idempotent(key="message_id", consumer="test-unverified", external=True)
    def charge(message: dict[str, Any], *, idempotency_key: str) -> None:
        calls.append(idempotency_key)
        raise ConnectionError("reset by peer")

    msg = event()
    with pytest.raises(ConnectionError):
        charge(msg)
    settings.IDEMPOTENT_ORDERS = {**settings.IDEMPOTENT_ORDERS, "RECONCILE_MAX_STALLS": 1}
    assert reconcile.reconcile().actions == {"retry": 1}  # unknown: not called again
    assert reconcile.reconcile().actions == {"failed": 1}
    assert len(calls) == 1
    with pytest.raises(CallFailed):
        charge(msg)


def test_a_live_lease_makes_a_concurrent_call_wait_for_it() -> None:
    msg = event()
    leases.claim(consumer="partner-webhook", message_id=msg["message_id"], token=0)
    with pytest.raises(CallInProgress):
        notify_partner(msg)
    assert reconcile.reconcile().actions == {}  # not expired: still someone's
    assert webhooks.effects(msg["message_id"]) == 0


def test_refused_inside_a_transaction_and_for_unserialisable_arguments() -> None:
    with transaction.atomic(), pytest.raises(RuntimeError, match="inside a transaction"):
        notify_partner(event())

    @idempotent(key="message_id", consumer="test-objects", external=True)
    def send(message: dict[str, Any], *, idempotency_key: str) -> None: ...

    with pytest.raises(TypeError, match="JSON"):
        send({"message_id": "x", "when": object()})
    assert not ProcessedMessage.objects.filter(consumer="test-objects").exists()


def test_callers_and_celery_do_not_pass_the_idempotency_key() -> None:
    assert "idempotency_key" not in inspect.signature(notify_partner.run).parameters
    msg = event()
    assert notify_partner.apply(args=[msg]).get() == {"notified": msg["message_id"]}
    with pytest.raises(ValueError, match="verify"):
        idempotent(lambda m: None, key="k", consumer="c", verify=lambda key: True)
    with pytest.raises(ValueError, match="default database"):
        idempotent(lambda m: None, key="k", consumer="c", external=True, using="other")


def test_load_step_uses_the_registry_and_ignores_unimportable_modules() -> None:
    registered = ProcessedMessage(consumer="partner-webhook", body="")
    assert load_step(registered) is leases.get_step("partner-webhook") is not None
    unknown = ProcessedMessage(consumer="nobody", body='{"module": "no.such.module"}')
    assert load_step(unknown) is None
    assert load_step(ProcessedMessage(consumer="nobody", body="not json")) is None
