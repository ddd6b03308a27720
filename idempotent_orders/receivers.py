"""Signal receivers connected in ``AppConfig.ready``."""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import receiver

from idempotent_orders.conf import conf
from idempotent_orders.models import Order, OrderStatus
from idempotent_orders.signals import order_transitioned

logger = logging.getLogger("idempotent_orders")


@receiver(order_transitioned, sender=Order, dispatch_uid="idempotent_orders.fulfil_after_payment")
def enqueue_fulfilment(sender: type[Order], order: Order, target: str, **kwargs: Any) -> None:
    """After a payment commits, start fulfilment (never before: the task must see the row)."""
    if target != OrderStatus.PAID or not conf.FULFIL_AFTER_PAYMENT:
        return
    from idempotent_orders.tasks import fulfil_order

    try:
        fulfil_order.apply_async(args=[order.pk], task_id=f"fulfil-{order.pk}")
    except Exception:
        # The payment is committed; a broker outage must not turn it into an error.
        # The order stays `paid` and is visible to operators (and the reconciler).
        logger.exception(
            "could not enqueue fulfilment of order %s", order.pk, extra={"order_id": order.pk}
        )
