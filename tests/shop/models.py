"""``shop.Order``: its own state field name, its own states, an extra transition, a condition
and a permission."""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.db import models
from django_fsm import (
    GET_STATE,
    RETURN_VALUE,
    ConcurrentTransitionMixin,
    FSMField,
    FSMIntegerField,
    FSMKeyField,
    transition,
)

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


class Stage(models.Model):
    """The states of the ``kstate`` FSMKeyField, as rows (django-fsm-2's own test shape)."""

    id = models.CharField(primary_key=True, max_length=16)

    def __str__(self) -> str:
        return self.id


class Order(AbstractOrder):
    #: ``flow``, ``istate`` and ``kstate`` are state fields of the proxies below
    #: (the differential suite's shapes); the shop's own state is ``phase``.
    state_field_name = "phase"

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
    flow = FSMField(default="new")
    istate = FSMIntegerField(default=0)
    kstate = FSMKeyField(Stage, null=True, blank=True, default=None, on_delete=models.PROTECT)
    paid_total = models.DecimalField(max_digits=10, decimal_places=2, default=0)
    note = models.CharField(max_length=200, blank=True, default="")

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


class Payment(models.Model):
    """A payment a transition body records (a real shop's ``OrderPayment``)."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="payments")
    payment_id = models.CharField(max_length=64, unique=True)
    amount = models.DecimalField(max_digits=10, decimal_places=2)

    def __str__(self) -> str:
        return f"payment {self.payment_id} of {self.amount}"


# -- The differential suite's shapes: proxies of Order, each driving another state field ----


def has_payment(order: Order) -> bool:
    """A condition that reads rows an earlier transition's body wrote."""
    return order.payments.exists()


def paid_in_full(order: Order) -> bool:
    return order.paid_total >= order.amount


def _route(order: Order, express: bool = False) -> str:
    return "express" if express else "standard"


class FlowOrder(Order):
    """Bodies, conditions, on_error, RETURN_VALUE/GET_STATE, targetless, "*" and "+", on a
    state field without choices (the shapes of django-fsm-2's own test models).
    """

    state_field_name = "flow"

    class Meta:
        proxy = True

    # --8<-- [start:partial-payment]
    @transition(field="flow", source=["new", "part_paid"], target=RETURN_VALUE("part_paid", "paid"))
    def pay(self, payment_id: str, amount: str) -> str:
        """Records the payment; the order is paid once the payments cover the amount."""
        Payment.objects.create(order=self, payment_id=payment_id, amount=Decimal(amount))
        self.paid_total += Decimal(amount)
        return "paid" if self.paid_total >= self.amount else "part_paid"

    @transition(field="flow", source="paid", target="shipped", conditions=[has_payment])
    def ship(self, tracking_number: str, carrier: str = "") -> None:
        self.tracking_number = tracking_number

    # --8<-- [end:partial-payment]

    @transition(field="flow", source="+", target="cancelled")
    def cancel(self, reason: str = "") -> None:
        self.note = f"cancelled: {reason}"

    @transition(field="flow", source="*", target=None)
    def remark(self, text: str) -> None:
        """Targetless: the state stays, the body runs."""
        self.note = text

    @transition(field="flow", source="paid", target="checked", on_error="failed")
    def review(self, fail: bool = False) -> None:
        self.note = "checked"
        if fail:
            raise ValueError("the fraud check failed")

    @transition(field="flow", source="new", target="paid")
    def crash(self) -> None:
        raise RuntimeError("a bug in the body")

    @transition(
        field="flow", source="paid", target=GET_STATE(_route, states=["express", "standard"])
    )
    def route(self, express: bool = False) -> None:
        self.note = "routed"

    @transition(field="flow", source="part_paid", target="paid", conditions=[paid_in_full])
    def settle_up(self) -> None:
        self.note = "settled up"

    @transition(field="flow", source="*", target=None)
    def unassign(self) -> None:
        """Targetless: the body writes NULL into a column."""
        self.customer = None

    @transition(field="flow", source="paid", target=None)
    def acknowledge(self) -> None:
        """Targetless, and its body calls another transition (a real shop's shape)."""
        self.note = "acknowledged"
        self.ship(tracking_number="auto")


class ConcurrentFlowOrder(ConcurrentTransitionMixin, FlowOrder):
    """FlowOrder with django-fsm-2's ConcurrentTransitionMixin (receivers may save it)."""

    class Meta:
        proxy = True


class Level(models.IntegerChoices):
    NEW = 0, "new"
    SUBMITTED = 1, "submitted"
    APPROVED = 2, "approved"
    DECLINED = 3, "declined"


class IntOrder(Order):
    """An FSMIntegerField state."""

    state_field_name = "istate"

    class Meta:
        proxy = True

    @transition(field="istate", source=Level.NEW, target=Level.SUBMITTED)
    def submit(self, text: str = "") -> None:
        self.note = text

    @transition(field="istate", source=Level.SUBMITTED, target=Level.APPROVED)
    def approve(self) -> None:
        self.note = "approved"

    @transition(field="istate", source=[Level.NEW, Level.SUBMITTED], target=Level.DECLINED)
    def decline(self) -> None:
        pass


class KeyOrder(Order):
    """An FSMKeyField state: the states are rows of Stage."""

    state_field_name = "kstate"

    class Meta:
        proxy = True

    @transition(field="kstate", source="new", target="paid")
    def kpay(self, payment_id: str) -> None:
        self.note = payment_id

    @transition(field="kstate", source="paid", target="shipped")
    def kship(self) -> None:
        pass

    @transition(field="kstate", source=["new", "paid"], target="cancelled")
    def kcancel(self) -> None:
        pass


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
