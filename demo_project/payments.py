"""FakePay, the demo's payment provider: a payment page that sends a signed webhook.

Clicking "Pay" on ``/shop/orders/<pk>/pay/`` plays the provider: it builds a
Stripe-style ``payment_intent.succeeded`` event for the order, signs it with
the ``fakepay`` secret (``Stripe-Signature: t=…,v1=…``) and POSTs it to the
shop's own webhook endpoint over HTTP, once or several times with the same
event id (as a provider retries). The endpoint stores it and the Celery worker
consumes it through the inbox: however many deliveries, the order is paid once.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse

from idempotent_orders import get_order_model
from idempotent_orders.consuming.graph import current_state, state_field
from idempotent_orders.http.forms import idempotent_form
from idempotent_orders.webhooks.signing import stripe_signature

PROVIDER = "fakepay"


def _order(request: HttpRequest, pk: int) -> Any:
    order: Any = get_order_model()._default_manager.filter(pk=pk).first()
    user = request.user
    mine = order is not None and (
        pk in request.session.get("shop_orders", [])
        or (user.is_authenticated and (user.is_staff or order.customer_id == user.pk))
    )
    if not mine:
        raise Http404("No such order")
    return order


def payment_event(order: Any, *, event_id: str | None = None) -> dict[str, Any]:
    """A ``payment_intent.succeeded`` event paying ``order`` in full."""
    minor = int((Decimal(order.amount) * 100).to_integral_value())
    return {
        "id": event_id or f"evt_{uuid.uuid4().hex[:24]}",
        "object": "event",
        "type": "payment_intent.succeeded",
        "created": int(time.time()),
        "data": {
            "object": {
                "id": f"pi_{uuid.uuid4().hex[:24]}",
                "object": "payment_intent",
                "amount": minor,
                "amount_received": minor,
                "currency": str(order.currency).lower(),
                "metadata": {"order_id": str(order.pk)},
            }
        },
    }


def signed(event: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """The body and headers FakePay sends for ``event``."""
    secret = settings.IDEMPOTENT_ORDERS["WEBHOOKS"][PROVIDER]["SECRET"]
    body = json.dumps(event).encode()
    return body, {
        "Content-Type": "application/json",
        "Stripe-Signature": stripe_signature(secret, body),
    }


def deliver(url: str, body: bytes, headers: dict[str, str]) -> int:
    """POST one delivery; the HTTP status the endpoint answered."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def awaits_payment(order: Any) -> bool:
    """Whether ``order`` can still be paid (the Pay button is shown only then)."""
    model = get_order_model()
    return str(current_state(order)) == str(state_field(model).get_default())


def pay_page(request: HttpRequest, pk: int) -> HttpResponse:
    order = _order(request, pk)
    if not awaits_payment(order):
        # Paid already (or cancelled): no second charge to offer.
        messages.info(request, f"Order {order.pk} does not await a payment: nothing to pay.")
        return HttpResponseRedirect(reverse("shop-order", args=[order.pk]), status=303)
    if request.method != "POST":
        return render(request, "shop/pay.html", {"order": order})
    return _pay(request, order)


@idempotent_form(on_failure="release")  # it calls FakePay: no transaction held open
def _pay(request: HttpRequest, order: Any) -> HttpResponse:
    """One charge per Pay form: a double click (the same one-time token) lands on the
    first click's result, and FakePay charges once."""
    try:
        times = min(max(int(request.POST.get("deliveries") or 1), 1), 5)
    except ValueError:
        times = 1
    body, headers = signed(payment_event(order))
    url = request.build_absolute_uri(reverse("idempotent_orders_webhooks:webhook", args=[PROVIDER]))
    answers = [deliver(url, body, headers) for _ in range(times)]
    messages.info(
        request,
        f"FakePay sent the payment webhook {times} time(s); the shop answered "
        f"{', '.join(map(str, answers))}. Refresh in a moment to see the order paid.",
    )
    return HttpResponseRedirect(reverse("shop-order", args=[order.pk]), status=303)
