"""Creating orders idempotently: one order per customer's basket and time window."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, transaction
from django.db.models import Model

from idempotent_orders import get_order_model
from idempotent_orders.conf import conf
from idempotent_orders.models import AbstractOrder

__all__ = [
    "CREATE_ORDER_FIELDS",
    "RaceLost",
    "create_order",
    "missing_create_fields",
    "order_business_key",
    "reruns_on_race",
]


class RaceLost(IntegrityError):
    """:func:`create_order` lost the race for its business key inside a transaction
    that its owner runs again whole (see :func:`reruns_on_race`)."""


#: The database whose outermost ``atomic`` block is run again whole on :class:`RaceLost`.
_rerun_on: ContextVar[str | None] = ContextVar("idempotent_orders_rerun_on", default=None)


@contextmanager
def reruns_on_race(using: str = DEFAULT_DB_ALIAS) -> Iterator[None]:
    """Entered by the owner of the outermost ``atomic`` block on ``using``, who runs the
    block again from its start when it raises :class:`RaceLost` (as after a deadlock).

    Directly in such a block :func:`create_order` inserts without a savepoint (two
    round trips fewer): a lost race then aborts the whole transaction, and the run
    after it finds the winner's order. ``@idempotent_view`` runs a view so.
    """
    token = _rerun_on.set(using)
    try:
        yield
    finally:
        _rerun_on.reset(token)


def order_business_key(
    *,
    customer: Any,
    items: list[dict[str, Any]],
    window: int,
    at: float,
    anonymous_id: str = "",
) -> str:
    """SHA-256 of customer, the normalised items and the time window ``at`` falls in.

    Items are merged by SKU and sorted, so the same basket typed in another
    order is the same business order. Two requests on either side of a window
    boundary get different keys (the price of a stateless key; documented).
    """
    basket: dict[str, int] = {}
    for item in items:
        basket[str(item["sku"])] = basket.get(str(item["sku"]), 0) + int(item["quantity"])
    owner = f"user:{customer.pk}" if customer is not None else f"anon:{anonymous_id}"
    slot = int(at // window)
    raw = json.dumps([owner, sorted(basket.items()), slot], separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()


def create_order(
    *,
    customer: Any,
    items: list[dict[str, Any]],
    amount: Any,
    currency: str,
    window: int | None = None,
    anonymous_id: str = "",
    at: float | None = None,
) -> tuple[AbstractOrder, bool]:
    """The order for this customer's basket in the current time window: ``(order, created)``.

    Concurrent callers race on the unique ``business_key`` index; the loser's
    insert fails and it reads the winner's row, so every caller gets the one
    order. ``anonymous_id`` (e.g. the session key) separates anonymous customers.
    The order model needs the fields in :data:`CREATE_ORDER_FIELDS`
    (``business_key`` unique); system check ``idempotent_orders.W041`` names
    any that a swapped-in model lacks.
    """
    model = get_order_model()
    missing = missing_create_fields(model)
    if missing:
        raise ImproperlyConfigured(
            f"create_order() needs the fields {', '.join(missing)} on "
            f"{model._meta.label}; create your orders your own way, or add them"
        )
    if not items:
        raise ValueError("an order needs at least one item")
    key = order_business_key(
        customer=customer,
        items=items,
        window=window or conf.ORDER_WINDOW,
        at=time.time() if at is None else at,
        anonymous_id=anonymous_id,
    )
    orders: Any = model._default_manager  # the fields were checked above
    existing = orders.filter(business_key=key).first()
    if existing is not None:
        return existing, False
    # A savepoint lets a lost race be survived inside the caller's transaction; a
    # transaction that is run again whole on a lost race needs none.
    blocks = connections[DEFAULT_DB_ALIAS].atomic_blocks
    savepoint = not (_rerun_on.get() == DEFAULT_DB_ALIAS and len(blocks) == 1)
    try:
        with transaction.atomic(savepoint=savepoint):
            order = orders.create(
                business_key=key, customer=customer, amount=amount, currency=currency
            )
    except IntegrityError as exc:
        if not savepoint:
            raise RaceLost(f"another request created the order {key} first") from exc
        # A concurrent caller won the insert. A locking read sees its committed
        # row even inside a REPEATABLE READ snapshot taken before the race.
        with transaction.atomic():
            return orders.select_for_update().get(business_key=key), False
    return order, True


#: Fields :func:`create_order` sets on the order model.
CREATE_ORDER_FIELDS = ("business_key", "customer", "amount", "currency")


def missing_create_fields(model: type[Model]) -> list[str]:
    """The :data:`CREATE_ORDER_FIELDS` ``model`` lacks (``business_key`` must also be unique)."""
    names = {f.name: f for f in model._meta.concrete_fields}
    missing = [name for name in CREATE_ORDER_FIELDS if name not in names]
    key = names.get("business_key")
    if key is not None and not key.unique:
        missing.append("business_key (unique)")
    return missing
