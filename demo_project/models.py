"""Demo models: the shop's own order model, a loyalty account, the fake warehouse's tables."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models.functions import Now
from django.utils import timezone
from django_fsm import FSMField, transition

from idempotent_orders.models import AbstractOrder


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


class ShopState(models.TextChoices):
    AWAITING_PAYMENT = "awaiting_payment", "awaiting payment"
    PAID = "paid", "paid"
    PICKING = "picking", "picking"
    PACKED = "packed", "packed"
    IN_TRANSIT = "in_transit", "in transit"
    DELIVERED = "delivered", "delivered"
    CANCELLED = "cancelled", "cancelled"
    EXPIRED = "expired", "expired"
    REFUNDED = "refunded", "refunded"


St = ShopState


class ShopOrder(AbstractOrder):
    """The demo shop's own order model, swapped in with ``IDEMPOTENT_ORDERS_ORDER_MODEL``.

    Its state field is ``state`` (not ``status``), its states are the shop's own,
    and it has a step the default model lacks (``pack``). The message types are
    bound to these transitions in :class:`demo_project.apps.DemoProjectConfig`.
    """

    business_key = models.CharField(max_length=128, unique=True)
    customer = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    amount = models.DecimalField(max_digits=12, decimal_places=2)
    currency = models.CharField(max_length=3)
    state = FSMField(choices=ShopState.choices, default=ShopState.AWAITING_PAYMENT, protected=True)
    payment_id = models.CharField(max_length=128, blank=True, default="")
    #: What the payment captured (``amount`` is what the order costs) and when.
    amount_paid = models.DecimalField(max_digits=12, decimal_places=2, null=True, blank=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    tracking_number = models.CharField(max_length=128, blank=True, default="")
    carrier = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"Shop order {self.pk} ({self.state}, v{self.version})"

    # A consumed message calls the transition with the payload's entries its
    # parameters name (``payment.succeeded``: payment_id, amount, currency), and
    # the fields the body sets are written with the state and version.

    @transition(field=state, source=St.AWAITING_PAYMENT, target=St.PAID)
    def mark_paid(
        self, payment_id: str, amount: Decimal | str, currency: str | None = None
    ) -> None:
        """Payment captured: record which payment, how much it took and when."""
        if currency is not None and currency != self.currency:
            raise ValueError(f"payment in {currency!r}, order priced in {self.currency!r}")
        self.payment_id = payment_id
        # The payload carries the amount as a decimal string ("88.00").
        self.amount_paid = Decimal(str(amount))
        self.paid_at = timezone.now()

    @transition(field=state, source=St.PAID, target=St.PICKING)
    def start_picking(self) -> None:
        """The warehouse accepted the order and is picking it."""

    @transition(field=state, source=St.PICKING, target=St.PACKED)
    def pack(self) -> None:
        """Parcel packed, waiting for the carrier."""

    @transition(field=state, source=[St.PAID, St.PICKING, St.PACKED], target=St.IN_TRANSIT)
    def dispatch(self, tracking_number: str, carrier: str) -> None:
        """Parcel handed to the carrier (possibly before our own steps were recorded)."""
        self.tracking_number = tracking_number
        self.carrier = carrier

    @transition(field=state, source=St.IN_TRANSIT, target=St.DELIVERED)
    def deliver(self) -> None:
        """Parcel delivered."""

    @transition(field=state, source=St.AWAITING_PAYMENT, target=St.CANCELLED)
    def cancel(self) -> None:
        """Cancelled before payment."""

    @transition(field=state, source=St.AWAITING_PAYMENT, target=St.EXPIRED)
    def expire(self) -> None:
        """Not paid in time."""

    @transition(field=state, source=St.PAID, target=St.REFUNDED)
    def refund(self) -> None:
        """Payment returned before picking started."""
