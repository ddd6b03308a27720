"""``shop.Order``: its own state field name, its own states, an extra transition, a condition
and a permission."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django_fsm import FSMField, transition

from idempotent_orders.models import AbstractOrder


class Phase(models.TextChoices):
    NEW = "new", "new"
    SETTLED = "settled", "settled"
    PICKING = "picking", "picking"
    ON_HOLD = "on_hold", "on hold"
    SENT = "sent", "sent"
    RECEIVED = "received", "received"
    VOIDED = "voided", "voided"


P = Phase


def not_blocked(order: Order) -> bool:
    """A blocked customer's payment is not taken (fraud review)."""
    return not order.blocked


class Order(AbstractOrder):
    business_key = models.CharField(max_length=128, unique=True)
    customer = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    currency = models.CharField(max_length=3)
    phase = FSMField(choices=Phase.choices, default=Phase.NEW, protected=True)
    tracking_number = models.CharField(max_length=64, blank=True, default="")
    blocked = models.BooleanField(default=False)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"shop order {self.pk} ({self.phase})"

    @transition(field=phase, source=P.NEW, target=P.SETTLED, conditions=[not_blocked])
    def settle(self) -> None:
        """Payment received."""

    @transition(field=phase, source=P.SETTLED, target=P.PICKING)
    def pick(self) -> None:
        """The warehouse started picking."""

    @transition(field=phase, source=P.PICKING, target=P.ON_HOLD)
    def hold(self) -> None:
        """Picking paused (an item is missing)."""

    @transition(field=phase, source=[P.SETTLED, P.PICKING, P.ON_HOLD], target=P.SENT)
    def send(self) -> None:
        """Parcel handed to the carrier."""

    @transition(field=phase, source=P.SENT, target=P.RECEIVED)
    def receive(self) -> None:
        """Parcel delivered."""

    # Only who may delete orders may void one from the admin (a message voids it regardless).
    @transition(field=phase, source=P.NEW, target=P.VOIDED, permission="shop.delete_order")
    def void(self) -> None:
        """Cancelled before payment."""


class ParcelReturn(AbstractOrder):
    """A parcel the customer sends back, in the admin with ``OrderAdminMixin`` (not the order
    model). ``note`` records a remark without moving the state (``target=None``): the admin
    cannot draw it, so it offers no transition actions for this model.
    """

    parcel = models.CharField(max_length=64)
    status = FSMField(default="requested", protected=True)
    remark = models.CharField(max_length=255, blank=True, default="")

    def __str__(self) -> str:
        return f"return of {self.parcel} ({self.status})"

    @transition(field=status, source="requested", target="received")
    def receive(self) -> None:
        """The parcel is back in the warehouse."""

    @transition(field=status, source="*", target=None)
    def note(self, remark: str) -> None:
        """A remark on the return; the state stays."""
        self.remark = remark
