"""Demo Celery tasks built on ``@idempotent``."""

from __future__ import annotations

from typing import Any

from celery import Task, shared_task
from django.db.models import F

from demo_project import webhooks
from demo_project.models import LoyaltyAccount
from idempotent_orders.idempotent import idempotent


@shared_task(name="demo_project.award_points", bind=True, acks_late=True)
@idempotent(key="message_id", consumer="loyalty")
def award_points(self: Task, message: dict[str, Any]) -> dict[str, Any]:
    """Add ``message["points"]`` to a customer's account, once per ``message_id``."""
    account, _ = LoyaltyAccount.objects.get_or_create(customer=message["customer"])
    LoyaltyAccount.objects.filter(pk=account.pk).update(points=F("points") + message["points"])
    return {"customer": message["customer"], "awarded": message["points"]}


@shared_task(name="demo_project.notify_partner", bind=True, acks_late=True)
@idempotent(key="message_id", consumer="partner-webhook", external=True, verify=webhooks.delivered)
def notify_partner(self: Task, message: dict[str, Any], *, idempotency_key: str) -> dict[str, Any]:
    """Tell the partner about an event once per ``message_id``, even if a worker dies mid-call.

    The call runs under a lease; if the worker dies, the reconciler asks the
    partner (``webhooks.delivered``) before sending again with the same key.
    """
    webhooks.post(message["message_id"], message["data"], idempotency_key=idempotency_key)
    return {"notified": message["message_id"]}
