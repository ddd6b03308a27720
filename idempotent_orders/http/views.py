"""The token endpoint and the orders API (plain Django views, JSON in and out)."""

from __future__ import annotations

import functools
import json
from decimal import Decimal, InvalidOperation
from typing import Any

from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from idempotent_orders.exceptions import IdempotencyError
from idempotent_orders.http.keys import get_principal, idempotent
from idempotent_orders.http.problems import problem_from, problem_response
from idempotent_orders.http.tokens import issue_token
from idempotent_orders.models import Order
from idempotent_orders.services import create_order

__all__ = ["order_detail", "orders", "token_endpoint"]

MAX_ITEMS = 100
MAX_QUANTITY = 10_000


def _require_user(view: Any) -> Any:
    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        user = getattr(request, "user", None)
        if user is None or not user.is_authenticated:
            return problem_response(401, "not-authenticated", "Authentication required")
        return view(request, *args, **kwargs)

    return wrapper


def _require_json(request: HttpRequest) -> HttpResponse | None:
    # A JSON content type cannot be sent cross-site without a CORS preflight,
    # which is why these views can be CSRF-exempt (see the README).
    if request.content_type != "application/json":
        return problem_response(
            415, "unsupported-media-type", "Send Content-Type: application/json"
        )
    return None


def order_json(order: Order) -> dict[str, Any]:
    return {
        "id": order.pk,
        "status": order.status,
        "amount": str(order.amount),
        "currency": order.currency,
        "version": order.version,
    }


@csrf_exempt
@require_http_methods(["POST"])
@_require_user
def token_endpoint(request: HttpRequest) -> HttpResponseBase:
    """``POST`` → 201 ``{"token": ..., "expires_at": ...}``: a one-time token for the caller."""
    bad = _require_json(request)
    if bad is not None:
        return bad
    principal = get_principal(request)
    if principal is None:  # a custom resolver may refuse the caller
        return problem_response(401, "not-authenticated", "Authentication required")
    try:
        row = issue_token(principal)
    except IdempotencyError as exc:
        return problem_from(exc)
    return JsonResponse({"token": row.key, "expires_at": row.expires_at.isoformat()}, status=201)


class _Invalid(Exception):
    pass


def _parse_order(body: bytes) -> tuple[Decimal, str, list[dict[str, Any]]]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise _Invalid("the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise _Invalid("the body must be a JSON object")
    raw_amount = data.get("amount")
    if not isinstance(raw_amount, str):
        raise _Invalid('amount must be a decimal string such as "12.50"')
    try:
        amount = Decimal(raw_amount)
    except InvalidOperation:
        raise _Invalid('amount must be a decimal string such as "12.50"') from None
    if not amount.is_finite() or amount <= 0 or amount != amount.quantize(Decimal("0.01")):
        raise _Invalid("amount must be positive with at most two decimal places")
    if amount >= Decimal("1e10"):
        raise _Invalid("amount is too large")
    currency = data.get("currency")
    if not (
        isinstance(currency, str)
        and len(currency) == 3
        and currency.isascii()
        and currency.isalpha()
        and currency.isupper()
    ):
        raise _Invalid('currency must be a three-letter ISO 4217 code such as "CNY"')
    items = data.get("items")
    if not isinstance(items, list) or not 0 < len(items) <= MAX_ITEMS:
        raise _Invalid(f"items must be a list of 1 to {MAX_ITEMS} objects")
    clean = []
    for item in items:
        if not isinstance(item, dict):
            raise _Invalid("each item must be an object with sku and quantity")
        sku, quantity = item.get("sku"), item.get("quantity")
        if not (isinstance(sku, str) and 0 < len(sku) <= 64 and sku.isprintable()):
            raise _Invalid("sku must be a printable string of 1 to 64 characters")
        if not (
            isinstance(quantity, int)
            and not isinstance(quantity, bool)
            and 0 < quantity <= MAX_QUANTITY
        ):
            raise _Invalid(f"quantity must be an integer from 1 to {MAX_QUANTITY}")
        clean.append({"sku": sku, "quantity": quantity})
    return amount, currency, clean


@csrf_exempt
@require_http_methods(["POST"])
@_require_user
@idempotent
def orders(request: HttpRequest) -> HttpResponseBase:
    """``POST /api/orders/``: create (or find, by business key) the caller's order."""
    bad = _require_json(request)
    if bad is not None:
        return bad
    try:
        amount, currency, items = _parse_order(request.body)
    except _Invalid as exc:
        return problem_response(400, "invalid-order", "Invalid order", str(exc))
    order, created = create_order(
        customer=request.user, items=items, amount=amount, currency=currency
    )
    return JsonResponse(order_json(order), status=201 if created else 200)


@require_http_methods(["GET", "HEAD"])
@_require_user
def order_detail(request: HttpRequest, pk: int) -> HttpResponseBase:
    """``GET /api/orders/<id>/``: the order, to its customer or staff (404 to anyone else)."""
    order = Order.objects.filter(pk=pk).first()
    user = request.user
    if order is None or not (user.is_staff or order.customer_id == user.pk):
        return problem_response(404, "not-found", "No such order")
    return JsonResponse(order_json(order))
