"""django-SHOP's order workflow, as a shop runs it, on the app's ``AbstractOrder``.

The transitions, their sources and targets, conditions, ``RETURN_VALUE`` targets and the
``save()`` that runs the "auto" transitions are django-SHOP's own
(``shop.models.order.BaseOrder`` with ``ManualPaymentWorkflowMixin``,
``CancelOrderWorkflowMixin`` and ``SimpleShippingWorkflowMixin``), flattened into one
class. ``receive_payment`` is what a shop that takes payments as messages adds: the
payment row django-SHOP's admin inline creates, then its ``prepayment_deposited``.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.db import models
from django.db.models import Sum
from django_fsm import RETURN_VALUE, FSMField, transition

from idempotent_orders.models import AbstractOrder

CANCELABLE_SOURCES = {
    "new",
    "created",
    "payment_confirmed",
    "payment_declined",
    "ready_for_delivery",
    "awaiting_payment",
    "prepayment_deposited",
    "no_payment_required",
}


class Order(AbstractOrder):
    business_key = models.CharField(max_length=128, unique=True)
    amount = models.DecimalField(max_digits=30, decimal_places=2)
    currency = models.CharField(max_length=7)
    status = FSMField(default="new", protected=True)
    _subtotal = models.DecimalField(max_digits=30, decimal_places=2, default=0)
    _total = models.DecimalField(max_digits=30, decimal_places=2, default=0)
    #: What the hooks of django-SHOP's workflow did, in order (its shipping and refunds).
    hooks = models.CharField(max_length=200, blank=True, default="")

    @property
    def total(self) -> Decimal:
        return self._total

    # -- BaseOrder ---------------------------------------------------------------------

    def save(self, *args: Any, **kwargs: Any) -> None:
        auto_transition = AUTO_TRANSITIONS.get(self.status)
        if auto_transition is not None:
            getattr(self, auto_transition)()
        self._subtotal = round(Decimal(self._subtotal), 2)
        self._total = round(Decimal(self._total), 2)
        super().save(*args, **kwargs)

    @property
    def amount_paid(self) -> Decimal:
        paid = self.orderpayment_set.aggregate(amount=Sum("amount"))["amount"]
        return paid if paid is not None else Decimal(0)

    def is_fully_paid(self) -> bool:
        return self.amount_paid >= self.total

    @transition(field=status, source="new", target="created")
    def populate_from_cart(self) -> None:
        """The cart became this order."""

    @transition(field="status", source="*", target="payment_confirmed", conditions=[is_fully_paid])
    def acknowledge_payment(self, by: Any = None) -> None:
        """Fully paid."""

    def cancelable(self) -> bool:
        return self.status in CANCELABLE_SOURCES

    def refund_payment(self) -> None:
        self.hooks += "refund;"

    def withdraw_from_delivery(self) -> None:
        self.hooks += "withdraw;"

    # -- ManualPaymentWorkflowMixin ------------------------------------------------------

    @transition(field="status", source=["created"], target="no_payment_required")
    def no_payment_required(self) -> None:
        """Nothing to pay."""

    @transition(field="status", source=["created"], target="awaiting_payment")
    def awaiting_payment(self) -> None:
        """Awaits a forward fund payment."""

    def payment_deposited(self) -> bool:
        return self.amount_paid > 0

    @transition(
        field="status",
        source=["awaiting_payment"],
        target=RETURN_VALUE("awaiting_payment", "prepayment_deposited"),
        conditions=[payment_deposited],
    )
    def prepayment_deposited(self) -> str:
        return "prepayment_deposited" if self.is_fully_paid() else "awaiting_payment"

    @transition(
        field="status",
        source=["prepayment_deposited", "no_payment_required"],
        custom={"auto": True},
    )
    def acknowledge_prepayment(self) -> None:
        self.acknowledge_payment()

    @transition(
        field="status",
        source="refund_payment",
        target=RETURN_VALUE("refund_payment", "order_canceled"),
    )
    def payment_refunded(self) -> str:
        return "refund_payment" if self.amount_paid else "order_canceled"

    # -- CancelOrderWorkflowMixin ------------------------------------------------------

    @transition(
        field="status",
        target=RETURN_VALUE("refund_payment", "order_canceled"),
        conditions=[cancelable],
    )
    def cancel_order(self) -> str:
        self.withdraw_from_delivery()
        if self.amount_paid:
            self.refund_payment()
        return "refund_payment" if self.amount_paid else "order_canceled"

    # -- SimpleShippingWorkflowMixin ---------------------------------------------------

    @transition(field="status", source="payment_confirmed", target="pick_goods")
    def pick_goods(self, by: Any = None) -> None:
        """Picking."""

    @transition(field="status", source="pick_goods", target="pack_goods")
    def pack_goods(self, by: Any = None) -> None:
        """Packing."""

    @transition(field="status", source="pack_goods", target="ship_goods")
    def ship_goods(self, by: Any = None) -> None:
        """Ship the goods."""

    @transition(
        field="status", source="ship_goods", target="ready_for_delivery", custom={"auto": True}
    )
    def prepare_for_delivery(self, by: Any = None) -> None:
        """Put the parcel into the outgoing delivery (invoked by save())."""

    # -- What a shop taking payments as messages adds ----------------------------------

    @transition(
        field="status",
        source=["awaiting_payment"],
        target=RETURN_VALUE("awaiting_payment", "prepayment_deposited"),
    )
    def receive_payment(self, payment_id: str, amount: str) -> str:
        OrderPayment.objects.create(order=self, transaction_id=payment_id, amount=Decimal(amount))
        return self.prepayment_deposited()


def _auto_transitions() -> dict[str, str]:
    """django-SHOP's ``_auto_transitions``: source state -> the ``auto`` transition."""
    found = {}
    for name in ("acknowledge_prepayment", "prepare_for_delivery"):
        for source, declared in getattr(Order, name)._django_fsm.transitions.items():
            if declared.custom.get("auto"):
                found[source] = name
    return found


class OrderPayment(models.Model):
    order = models.ForeignKey(Order, on_delete=models.CASCADE)
    amount = models.DecimalField(max_digits=30, decimal_places=2)
    transaction_id = models.CharField(max_length=255, unique=True)

    def __str__(self) -> str:
        return f"{self.transaction_id}: {self.amount}"


AUTO_TRANSITIONS = _auto_transitions()
