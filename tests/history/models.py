"""``history.Order``: an order model as shops write it, with what runs on its ``save()``.

A ``save()`` override that derives ``total`` and writes a search-index row after
``super().save()``, a ``post_save`` receiver that records each call, django-simple-history's
``HistoricalRecords``, django-pghistory's triggers (PostgreSQL), django-auditlog and
django-reversion (registered in ``apps.py``).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pghistory
from django.db import models
from django.db.models.signals import post_save
from django_fsm import FSMField, transition
from simple_history.models import HistoricalRecords

from idempotent_orders.models import AbstractOrder

SHIPPING_FEE = Decimal("4.90")


@pghistory.track()
class Order(AbstractOrder):
    business_key = models.CharField(max_length=128, unique=True)
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    currency = models.CharField(max_length=3)
    status = FSMField(default="new", protected=True)
    payment_id = models.CharField(max_length=128, blank=True, default="")
    tracking_number = models.CharField(max_length=128, blank=True, default="")
    carrier = models.CharField(max_length=64, blank=True, default="")
    shipping_fee = models.DecimalField(max_digits=10, decimal_places=2, default=0)
    #: Derived in save(): what the customer pays, shipping included once shipped.
    total = models.DecimalField(max_digits=10, decimal_places=2, default=0)
    updated_at = models.DateTimeField(auto_now=True)

    history = HistoricalRecords(excluded_fields=["version", "last_seq", "has_parked"])

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.total = self.amount + self.shipping_fee
        super().save(*args, **kwargs)
        SearchEntry.objects.update_or_create(
            order_id=self.pk, defaults={"text": f"{self.status} {self.tracking_number}".strip()}
        )

    @transition(field=status, source="new", target="paid")
    def pay(self, payment_id: str = "") -> None:
        self.payment_id = payment_id

    @transition(field=status, source="paid", target="shipped")
    def ship(self) -> None:
        self.shipping_fee = SHIPPING_FEE

    @transition(field=status, source="shipped", target="completed")
    def complete(self) -> None:
        """Delivered."""

    @transition(field=status, source="paid", target="on_hold")
    def hold(self, reason: str = "") -> None:
        self.carrier = reason
        if reason == "boom":
            raise ValueError("the warehouse system is down")

    @transition(field=status, source="on_hold", target="new")
    def reset(self) -> None:
        """Back to the start after a hold (the graph has a cycle)."""

    @transition(field=status, source="new", target="cancelled")
    def cancel(self) -> None:
        """Cancelled before payment."""


class SearchEntry(models.Model):
    """What the save() override writes after ``super().save()``."""

    order_id = models.BigIntegerField(unique=True)
    text = models.CharField(max_length=300)

    def __str__(self) -> str:
        return self.text


class SavedCall(models.Model):
    """One call of the project's ``post_save`` receiver, as it saw the order."""

    order_id = models.BigIntegerField()
    status = models.CharField(max_length=32)
    total = models.DecimalField(max_digits=10, decimal_places=2)
    created = models.BooleanField()
    #: The message being consumed, as ``current_message()`` showed it ("" for none).
    message_id = models.CharField(max_length=255, blank=True, default="")
    tracking_number = models.CharField(max_length=128, blank=True, default="")

    def __str__(self) -> str:
        return f"order {self.order_id} saved as {self.status}"


def record_save(sender: Any, instance: Order, created: bool, **kwargs: Any) -> None:
    from idempotent_orders.consuming import current_message

    message = current_message()
    SavedCall.objects.create(
        order_id=instance.pk,
        status=instance.status,
        total=instance.total,
        created=created,
        message_id=message.message_id if message else "",
        tracking_number=str(message.payload.get("tracking_number", "")) if message else "",
    )


def connect_receiver() -> None:
    post_save.connect(record_save, sender=Order, dispatch_uid="tests.history.record_save")
