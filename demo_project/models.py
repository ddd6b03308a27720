"""Demo models: a loyalty account for ``@idempotent``, and the fake warehouse's tables."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models.functions import Now


class LoyaltyAccount(models.Model):
    """Points per customer; awarding points twice for one message would be a bug."""

    customer = models.CharField(max_length=64, unique=True)
    points = models.IntegerField(default=0)
    #: Fencing token of the last locked write (see ``idempotent_orders.locks``).
    fence = models.PositiveBigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.customer}: {self.points} points"


class WarehouseRequest(models.Model):
    """One call the fake warehouse received; ``effect`` when it actually reserved stock.

    Deliberately not unique on the key: a second effect for one order must be
    visible to the tests, not hidden by the fake.
    """

    idempotency_key = models.CharField(max_length=128, db_index=True)
    order_id = models.BigIntegerField()
    mode = models.CharField(max_length=32)
    effect = models.BooleanField(default=False)
    #: The process that handled the call (tests find the worker to kill by it).
    pid = models.IntegerField(default=0)
    created_at = models.DateTimeField(db_default=Now())

    def __str__(self) -> str:
        return f"{self.mode} for order {self.order_id}"


class WarehouseScript(models.Model):
    """How the fake warehouse answers the next calls for one order (a list of modes)."""

    order_id = models.BigIntegerField(unique=True)
    modes: models.JSONField[Any] = models.JSONField(default=list)

    def __str__(self) -> str:
        return f"order {self.order_id}: {self.modes}"


class WebhookDelivery(models.Model):
    """One request the fake partner webhook received; ``effect`` when it acted on it.

    Not unique on the key either: a second effect must show in the tests.
    """

    idempotency_key = models.CharField(max_length=128, db_index=True)
    ref = models.CharField(max_length=255, db_index=True)
    mode = models.CharField(max_length=32)
    effect = models.BooleanField(default=False)
    pid = models.IntegerField(default=0)
    created_at = models.DateTimeField(db_default=Now())

    def __str__(self) -> str:
        return f"{self.mode} for {self.ref}"


class WebhookScript(models.Model):
    """How the fake webhook answers the next requests for one ``ref`` (a list of modes)."""

    ref = models.CharField(max_length=255, unique=True)
    modes: models.JSONField[Any] = models.JSONField(default=list)

    def __str__(self) -> str:
        return f"{self.ref}: {self.modes}"
