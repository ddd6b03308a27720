"""A task for the dead-letter worker test, imported by test workers (``CELERY_IMPORTS``).

Celery is told to retry it on any exception, without end and without delay:
only the inbox's dead letter can stop a message that keeps failing. Every run
appends its message id to ``message["runs"]`` (a file, outside the database, so
rolled-back runs count too); ``message["switch"]`` says what the run does:
``ok`` adds the points, ``missing`` raises a permanent ``LookupError``,
anything else a ``RuntimeError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from celery import Task, shared_task
from django.db.models import F

from demo_project.models import LoyaltyAccount
from idempotent_orders.idempotent import idempotent


@shared_task(
    name="tests.fragile_points",
    bind=True,
    acks_late=True,
    autoretry_for=(Exception,),
    max_retries=None,
    default_retry_delay=0,
)
@idempotent(key="message_id", consumer="test-fragile", permanent=(LookupError,), max_attempts=3)
def fragile_points(self: Task, message: dict[str, Any]) -> dict[str, Any]:
    with Path(message["runs"]).open("a") as out:
        out.write(message["message_id"] + "\n")
    switch = Path(message["switch"]).read_text().strip()
    if switch == "missing":
        raise LookupError(f"no customer {message['customer']}")
    if switch != "ok":
        raise RuntimeError("the points service is down")
    account, _ = LoyaltyAccount.objects.get_or_create(customer=message["customer"])
    LoyaltyAccount.objects.filter(pk=account.pk).update(points=F("points") + message["points"])
    return {"awarded": message["points"]}
