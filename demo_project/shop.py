"""Demo order creation: the order and its follow-up messages commit together (outbox)."""

from __future__ import annotations

from decimal import Decimal

from django.db import transaction

from demo_project.tasks import award_points
from idempotent_orders.models import Order
from idempotent_orders.outbox import publish_on_commit

#: Loyalty points per whole unit of the order's amount.
POINTS_PER_UNIT = 1


def place_order(*, business_key: str, customer: str, amount: Decimal, currency: str) -> Order:
    """Create an order and queue its follow-ups in the same transaction.

    If the transaction rolls back, no follow-up is ever sent; if the process
    dies after commit, the outbox relay sends them. The follow-up's message id
    derives from the order, so a retried publish awards the points once.
    """
    with transaction.atomic():
        order = Order.objects.create(business_key=business_key, amount=amount, currency=currency)
        publish_on_commit(
            award_points,
            {
                "message_id": f"order-points-{order.pk}",
                "customer": customer,
                "points": int(amount) * POINTS_PER_UNIT,
            },
        )
    return order
