"""The demo shop: a checkout form protected by a one-time token, and the order page."""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_http_methods

from demo_project.tasks import award_points
from idempotent_orders import get_order_model
from idempotent_orders.consuming.graph import state_field
from idempotent_orders.http.forms import idempotent_form
from idempotent_orders.orders import create_order
from idempotent_orders.outbox import publish_on_commit

#: The demo's catalogue: sku -> (name, unit price in CNY).
PRODUCTS = {
    "tea-longjing": ("Longjing green tea, 250 g", Decimal("88.00")),
    "cup-celadon": ("Celadon tea cup", Decimal("45.50")),
    "pot-yixing": ("Yixing clay teapot", Decimal("320.00")),
}
_SESSION_ORDERS = "shop_orders"


def shop(request: HttpRequest) -> HttpResponse:
    return render(request, "shop/index.html", {"products": PRODUCTS.items()})


@require_http_methods(["POST"])
@idempotent_form
def checkout(request: HttpRequest) -> HttpResponse:
    items: list[dict[str, Any]] = []
    for sku in PRODUCTS:
        try:
            quantity = int(request.POST.get(f"qty-{sku}") or 0)
        except ValueError:
            quantity = 0
        if 0 < quantity <= 99:
            items.append({"sku": sku, "quantity": quantity})
    if not items:
        # Re-render with an error: the token goes back, the page gets a fresh one.
        context = {"products": PRODUCTS.items(), "error": "Choose at least one item."}
        return render(request, "shop/index.html", context, status=400)
    # Lets a test hold the first submit open so the second arrives while it runs.
    time.sleep(float(getattr(settings, "DEMO_CHECKOUT_DELAY", 0)))
    amount = sum((PRODUCTS[i["sku"]][1] * i["quantity"] for i in items), Decimal("0"))
    user = request.user if request.user.is_authenticated else None
    session = request.session.session_key or ""
    # The order and its follow-up commit together; a repeat of the same basket
    # (another tab, a second token) finds the order and queues nothing more.
    with transaction.atomic():
        order, created = create_order(
            customer=user,
            items=items,
            amount=amount,
            currency="CNY",
            anonymous_id="" if user else session,
        )
        if created:
            queue_follow_ups(order, customer=f"user-{user.pk}" if user else f"session-{session}")
    seen = set(request.session.get(_SESSION_ORDERS, []))
    seen.add(order.pk)
    request.session[_SESSION_ORDERS] = sorted(seen)
    return HttpResponseRedirect(reverse("shop-order", args=[order.pk]), status=303)


def order_page(request: HttpRequest, pk: int) -> HttpResponse:
    order: Any = get_order_model()._default_manager.filter(pk=pk).first()
    user = request.user
    mine = order is not None and (
        pk in request.session.get(_SESSION_ORDERS, [])
        or (user.is_authenticated and (user.is_staff or order.customer_id == user.pk))
    )
    if not mine:
        raise Http404("No such order")
    state = state_field(get_order_model())
    label = dict(state.flatchoices).get(state.value_from_object(order), "")
    return render(request, "shop/order.html", {"order": order, "state_label": label})


#: Loyalty points per whole unit of the order's amount.
POINTS_PER_UNIT = 1


def place_order(*, business_key: str, customer: str, amount: Decimal, currency: str) -> Any:
    """Create an order and queue its follow-ups in the same transaction.

    If the transaction rolls back, no follow-up is ever sent; if the process
    dies after commit, the outbox relay sends them. The follow-up's message id
    derives from the order, so a retried publish awards the points once.
    """
    with transaction.atomic():
        orders: Any = get_order_model()._default_manager  # ShopOrder, or the default Order
        order = orders.create(business_key=business_key, amount=amount, currency=currency)
        queue_follow_ups(order, customer=customer)
    return order


def points_message_id(order_id: int) -> str:
    return f"order-points-{order_id}"


def queue_follow_ups(order: Any, *, customer: str) -> None:
    """Queue a new order's follow-up messages in the caller's transaction (the outbox).

    Call it only in the transaction that created ``order``; the message id
    derives from the order, so even a second call would award the points once.
    """
    publish_on_commit(
        award_points,
        {
            "message_id": points_message_id(order.pk),
            "customer": customer,
            "points": int(order.amount) * POINTS_PER_UNIT,
        },
    )
