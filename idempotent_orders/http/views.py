"""The token endpoint, the orders API and its OpenAPI document (plain Django views, JSON).

Every error these views answer is ``application/problem+json``, 405 included.
"""

from __future__ import annotations

import functools
import json
import re
from decimal import Decimal
from typing import Any

from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt

from idempotent_orders import get_order_model
from idempotent_orders.consuming.graph import current_state
from idempotent_orders.exceptions import IdempotencyError
from idempotent_orders.http.decorators import idempotent_view
from idempotent_orders.http.header import check_length
from idempotent_orders.http.principals import get_principal
from idempotent_orders.http.problems import problem_from, problem_response
from idempotent_orders.http.schema import MAX_ITEMS, MAX_QUANTITY, openapi
from idempotent_orders.http.tokens import issue_token
from idempotent_orders.models import AbstractOrder
from idempotent_orders.orders import create_order

__all__ = ["order_detail", "orders", "schema", "token_endpoint"]


def _allow(*methods: str) -> Any:
    """Like ``require_http_methods``, with a problem+json 405 (and ``Allow``)."""

    def decorate(view: Any) -> Any:
        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if request.method not in methods:
                response = problem_response(
                    405,
                    "method-not-allowed",
                    "Method not allowed",
                    f"{request.method} is not allowed here; use {' or '.join(methods)}",
                )
                response["Allow"] = ", ".join(methods)
                return response
            return view(request, *args, **kwargs)

        return wrapper

    return decorate


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
    try:
        check_length(request)
    except IdempotencyError as exc:
        return problem_from(exc)
    return None


def order_json(order: AbstractOrder) -> dict[str, Any]:
    data: dict[str, Any] = {"id": order.pk, "status": current_state(order)}
    for name in ("amount", "currency"):
        if hasattr(order, name):
            data[name] = str(getattr(order, name))
    data["version"] = order.version
    return data


@csrf_exempt
@_allow("POST")
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


#: The amount as the OpenAPI document states it: ASCII digits, at most ten before
#: the point and two after. ``Decimal()`` alone would read any Unicode digit
#: (full-width digits, which the consumer refuses), exponents, ``_`` and
#: spaces, and raise on quantizing forty 9s or ``1e30``.
_AMOUNT = re.compile(r"[0-9]{1,10}(?:\.[0-9]{1,2})?", re.ASCII)


def _amount(raw: Any) -> Decimal:
    if not isinstance(raw, str):
        raise _Invalid('amount must be a decimal string such as "12.50"')
    if not _AMOUNT.fullmatch(raw):
        if raw.isascii() and re.fullmatch(r"[0-9]+(?:\.[0-9]+)?", raw):
            if "." in raw and len(raw.partition(".")[2]) > 2:
                raise _Invalid("amount must be positive with at most two decimal places")
            raise _Invalid("amount is too large")
        raise _Invalid(
            'amount must be a decimal string of ASCII digits such as "12.50"'
            " (no sign, exponent or spaces)"
        )
    amount = Decimal(raw)
    if amount <= 0:
        raise _Invalid("amount must be positive with at most two decimal places")
    return amount


def _parse_order(body: bytes) -> tuple[Decimal, str, list[dict[str, Any]]]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise _Invalid("the body is not valid JSON") from None
    except RecursionError:
        # The decoder recurses per nesting level: a deep body is refused, not a 500.
        raise _Invalid("the body is nested too deeply") from None
    if not isinstance(data, dict):
        raise _Invalid("the body must be a JSON object")
    amount = _amount(data.get("amount"))
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
@_allow("POST")
@_require_user
@idempotent_view
def orders(request: HttpRequest) -> HttpResponseBase:
    """``POST /api/orders/``: create (or find, by business key) the caller's order.

    201 (with ``Location``) when created, 200 when the same basket was ordered
    in this time window under another key.
    """
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
    if not created:
        return JsonResponse(order_json(order))
    response = JsonResponse(order_json(order), status=201)
    match = request.resolver_match
    response["Location"] = reverse(
        "idempotent_orders:order-detail",
        kwargs={"pk": order.pk},
        current_app=match.namespace if match else None,
    )
    return response


#: Order ids the database can hold (a bigger number is no order, not an overflow).
_MAX_ID_DIGITS = 18


@_allow("GET", "HEAD")
@_require_user
def order_detail(request: HttpRequest, pk: str) -> HttpResponseBase:
    """``GET /api/orders/<id>/``: the order, to its customer or staff (404 to anyone else)."""
    order = None
    if pk.isascii() and pk.isdigit() and len(pk) <= _MAX_ID_DIGITS:
        order = get_order_model()._default_manager.filter(pk=int(pk)).first()
    user = request.user
    if order is None or not (user.is_staff or getattr(order, "customer_id", None) == user.pk):
        return problem_response(404, "not-found", "No such order")
    return JsonResponse(order_json(order))


@_allow("GET", "HEAD")
def schema(request: HttpRequest) -> HttpResponseBase:
    """``GET /api/schema/``: the OpenAPI 3.1 document of these views."""
    server = request.path.removesuffix("schema/").rstrip("/")
    return JsonResponse(openapi(server), json_dumps_params={"indent": 1})
