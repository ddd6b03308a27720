"""The demo shop: a checkout form protected by a one-time token, and the order page."""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_http_methods

from demo_project.tasks import award_points
from idempotent_orders import get_order_model
from idempotent_orders.consuming.graph import edges, state_field
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


#: Most of one item a single order takes.
MAX_QUANTITY = 99


def _catalogue(quantities: dict[str, str] | None = None) -> list[tuple[str, Any, str]]:
    """``(sku, (name, price), quantity as typed)`` for the form, keeping what was typed."""
    quantities = quantities or {}
    return [(sku, product, quantities.get(sku, "0")) for sku, product in PRODUCTS.items()]


def shop(request: HttpRequest) -> HttpResponse:
    return render(request, "shop/index.html", {"products": _catalogue()})


def read_basket(data: Any) -> tuple[list[dict[str, Any]], list[str], dict[str, str]]:
    """The basket a form posted: ``(items, problems, quantities as typed)``.

    Every quantity that is not a whole number from 0 to ``MAX_QUANTITY`` is a
    problem said in words; none is dropped silently (a basket with a problem
    places no order).
    """
    items: list[dict[str, Any]] = []
    problems: list[str] = []
    typed: dict[str, str] = {}
    for sku, (name, _) in PRODUCTS.items():
        raw = (data.get(f"qty-{sku}") or "").strip()
        typed[sku] = raw or "0"
        try:
            quantity = int(raw or 0)
        except ValueError:
            problems.append(f"{name}: “{raw}” is not a number of items.")
            continue
        if quantity < 0:
            problems.append(f"{name}: {quantity} is below zero; choose 0 to leave it out.")
        elif quantity > MAX_QUANTITY:
            problems.append(
                f"{name}: {quantity} is more than the {MAX_QUANTITY} one order can take; "
                "place a second order for the rest, or write to us for a wholesale price."
            )
        elif quantity:
            items.append({"sku": sku, "quantity": quantity})
    if not items and not problems:
        problems.append("Choose at least one item.")
    return items, problems, typed


#: A token problem (the guard's problem+json), in words for a person at a form.
TOKEN_PROBLEMS = {
    400: "This form could not be checked (its one-time token was missing). Nothing was "
    "ordered; please place your order again.",
    403: "This form had expired or was not ours (its one-time token was unknown or too old). "
    "Nothing was ordered; please check your basket and place your order again.",
    409: "Your earlier click is still being placed. Wait a moment, then look at your orders "
    "(“Your orders”, at the top of the page) before trying again.",
    422: "This form was already used for a different basket. Nothing new was ordered; "
    "please check your basket and place your order again.",
}


def _wants_html(request: HttpRequest) -> bool:
    """A browser's form post (it asks for HTML); an API client gets problem+json."""
    return "text/html" in request.headers.get("Accept", "")


def _form_again(request: HttpRequest, problems: list[str], status: int) -> HttpResponse:
    """The form again with what went wrong, the quantities as typed and a fresh token."""
    _, _, typed = read_basket(request.POST)
    context = {"products": _catalogue(typed), "problems": problems}
    return render(request, "shop/index.html", context, status=status)


@require_http_methods(["GET", "POST"])
def checkout(request: HttpRequest) -> HttpResponse:
    """``POST``: place the order (token-protected); ``GET`` (a reload, a bookmark): the shop.

    A token the guard refuses (missing, expired, forged, reused for another
    basket) is answered to a browser with the form again, said in plain words
    with a fresh token; an API client keeps the problem+json answer.
    """
    if request.method != "POST":
        return HttpResponseRedirect(reverse("shop"), status=303)
    response = _checkout(request)
    refused = response.get("Content-Type", "").startswith("application/problem+json")
    if refused and response.status_code in TOKEN_PROBLEMS and _wants_html(request):
        code = response.status_code
        return _form_again(request, [TOKEN_PROBLEMS[code]], code)
    return response


@idempotent_form
def _checkout(request: HttpRequest) -> HttpResponse:
    items, problems, _ = read_basket(request.POST)
    if problems:
        # Re-render with what is wrong: the token goes back, the page gets a fresh one.
        return _form_again(request, problems, 400)
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


def _my_order(request: HttpRequest, pk: int) -> Any:
    order: Any = get_order_model()._default_manager.filter(pk=pk).first()
    user = request.user
    mine = order is not None and (
        pk in request.session.get(_SESSION_ORDERS, [])
        or (user.is_authenticated and (user.is_staff or order.customer_id == user.pk))
    )
    if not mine:
        raise Http404("No such order")
    return order


def my_orders(request: HttpRequest) -> HttpResponse:
    """The visitor's orders, newest first: those this session placed, and a signed-in
    customer's own."""
    from django.db.models import Q

    model = get_order_model()
    mine = Q(pk__in=request.session.get(_SESSION_ORDERS, []))
    user = request.user
    if user.is_authenticated and any(f.name == "customer" for f in model._meta.fields):
        mine |= Q(customer=user)
    orders = model._default_manager.filter(mine).order_by("-pk")[:50]
    rows = [(order, order_status(order)) for order in orders]
    return render(request, "shop/orders.html", {"rows": rows})


def order_status(order: Any) -> dict[str, Any]:
    """What the order page shows and polls: the state, in words, and whether it can change."""
    model = get_order_model()
    state = state_field(model)
    value = state.value_from_object(order)
    final = not any(e.allows(value) and not e.targetless for e in edges(model))
    return {
        "id": order.pk,
        "status": value,
        "label": str(dict(state.flatchoices).get(value, value)),
        "version": order.version,
        "final": final,
    }


def order_page(request: HttpRequest, pk: int) -> HttpResponse:
    """The order and its live status: the page polls :func:`order_status_json` (without
    JavaScript it reloads itself until the status is final)."""
    order = _my_order(request, pk)
    status = order_status(order)
    return render(
        request,
        "shop/order.html",
        {"order": order, "state_label": status["label"], "status": status},
    )


def order_status_json(request: HttpRequest, pk: int) -> JsonResponse:
    """The order's status as JSON, for the order page's polling (the customer's own orders)."""
    response = JsonResponse(order_status(_my_order(request, pk)))
    response["Cache-Control"] = "no-store"
    return response


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
