"""A fake warehouse for the demo and the tests: it can fail, hang, or lose its reply.

Its state lives in database tables (``WarehouseRequest``, ``WarehouseScript``),
so worker processes, the reconciler and the tests all see the same warehouse.
Name it in ``IDEMPOTENT_ORDERS["FULFILMENT_CLIENT"]``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from django.conf import settings
from django.db import transaction

from demo_project.models import WarehouseRequest, WarehouseScript, WebhookScript
from idempotent_orders.fulfilment import WarehouseClient, WarehouseError
from idempotent_orders.models import AbstractOrder

#: What a call can do: ``ok``; ``fail`` (refused, no effect); ``hang`` (no
#: effect, blocks, then times out); ``lose_reply`` (effect, then the reply is
#: lost); ``effect_then_hang`` (effect, then blocks before replying); ``slow``
#: (ok after a short pause, to make concurrent callers overlap).
MODES = ("ok", "fail", "hang", "lose_reply", "effect_then_hang", "slow")


def script(order_id: int, *modes: str) -> None:
    """Make the next calls for ``order_id`` behave as ``modes``, in order; then ``ok``."""
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)}; expected some of {MODES}")
    WarehouseScript.objects.update_or_create(order_id=order_id, defaults={"modes": list(modes)})


def effects(order_id: int | None = None) -> int:
    """How many times stock was actually reserved (for one order, or in total)."""
    rows = WarehouseRequest.objects.filter(effect=True)
    if order_id is not None:
        rows = rows.filter(order_id=order_id)
    return rows.count()


def next_scripted_mode(model: type[WarehouseScript] | type[WebhookScript], **lookup: Any) -> str:
    """Pop the next scripted answer of a fake (``"ok"`` once the script is used up)."""
    with transaction.atomic():
        row = model.objects.select_for_update().filter(**lookup).first()
        if row is None or not row.modes:
            return "ok"
        mode = str(row.modes[0])
        row.modes = row.modes[1:]
        row.save(update_fields=["modes"])
        return mode


def _next_mode(order_id: int) -> str:
    return next_scripted_mode(WarehouseScript, order_id=order_id)


class FakeWarehouse(WarehouseClient):
    def reserve(self, order: AbstractOrder, *, idempotency_key: str) -> None:
        mode = _next_mode(order.pk)
        effect = mode in {"ok", "lose_reply", "effect_then_hang", "slow"}
        if mode == "slow":
            time.sleep(0.1)
        WarehouseRequest.objects.create(
            idempotency_key=idempotency_key,
            order_id=order.pk,
            mode=mode,
            effect=effect,
            pid=os.getpid(),
        )
        if mode in {"ok", "slow"}:
            return
        if mode in {"hang", "effect_then_hang"}:
            time.sleep(getattr(settings, "DEMO_WAREHOUSE_HANG_SECONDS", 300))
            raise WarehouseError("the warehouse did not answer in time")
        if mode == "fail":
            raise WarehouseError("the warehouse refused the request")
        raise WarehouseError("connection reset while reading the reply")  # lose_reply

    def lookup(self, idempotency_key: str) -> bool | None:
        return WarehouseRequest.objects.filter(
            idempotency_key=idempotency_key, effect=True
        ).exists()
