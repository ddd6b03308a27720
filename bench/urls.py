"""The bench urlconf: the app's API, and the same order-create body under other decorators."""

from __future__ import annotations

import inspect
import json
import uuid
from decimal import Decimal
from typing import Any

from django.http import HttpRequest, HttpResponseBase, JsonResponse
from django.urls import include, path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods
from drf_idempotency import IdempotencyError
from drf_idempotency import idempotent as drf_idempotent
from drf_idempotency.core import build_error_response
from idempotency_key.decorators import idempotency_key

from idempotent_orders.http import idempotent_view, views
from idempotent_orders.models import Order

#: The body of ``POST /api/orders/`` without any decorator (csrf, methods, user, key).
order_body = inspect.unwrap(views.orders)


def plain_create(request: HttpRequest) -> HttpResponseBase:
    """A body that creates an order on every call (no business key dedup).

    With it, only the idempotency layer in front stands between 50 identical
    concurrent requests and 50 orders; that is what the concurrency figure shows.
    """
    data = json.loads(request.body)
    order = Order.objects.create(
        business_key=f"{data['tag']}-{uuid.uuid4().hex}",
        amount=Decimal(data["amount"]),
        currency=data["currency"],
    )
    return JsonResponse(views.order_json(order), status=201)


def canned(request: HttpRequest) -> HttpResponseBase:
    """An order's answer made up without any work: the ceiling of any replay on this stack.

    Behind the same outer layers as the others (the user, POST only), it costs a
    request what a replay cannot avoid: the server, the middleware, the caller's
    authentication; the key's read and the rebuilt response are what a replay adds.
    """
    response = JsonResponse(
        {"id": 1, "status": "pending_payment", "amount": "12.50", "currency": "CNY", "version": 0},
        status=201,
    )
    response["Location"] = "/api/orders/1/"
    return response


def _drf(view: Any) -> Any:
    """drf-idempotency's decorator, its errors turned into responses as its middleware does.

    (Its exceptions are DRF ``APIException``s, which only a DRF view would convert.)
    """
    inner = drf_idempotent()(view)

    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        try:
            return inner(request, *args, **kwargs)
        except IdempotencyError as exc:
            return build_error_response(exc)

    return wrapper


def _stack(body: Any, *decorators: Any) -> Any:
    view = body
    for decorate in decorators:
        view = decorate(view)
    # The same outer layers as the app's view: user required, POST only, JSON API.
    return csrf_exempt(require_http_methods(["POST"])(views._require_user(view)))


VARIANTS: dict[str, tuple[Any, ...]] = {
    "none": (),
    "ours": (idempotent_view,),
    "django-idempotency-key": (idempotency_key,),
    "drf-idempotency": (_drf,),
}

urlpatterns = [
    path("api/", include("idempotent_orders.http.urls")),
    path("bench/canned/orders/", _stack(canned)),
]
for name, decorators in VARIANTS.items():
    urlpatterns += [
        path(f"bench/{name}/orders/", _stack(order_body, *decorators)),
        path(f"bench/{name}/plain/", _stack(plain_create, *decorators)),
    ]
