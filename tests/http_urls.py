"""Demo URLs plus small views that exercise the idempotency machinery in tests."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from asgiref.sync import sync_to_async
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from django.urls import include, path
from django.views import View
from django.views.decorators.csrf import csrf_exempt

from demo_project.urls import urlpatterns as demo_urlpatterns
from idempotent_orders.http import IdempotentMixin, idempotent_view
from idempotent_orders.models import Order

#: How many times each test view body ran, by name.
RUNS: dict[str, int] = {}
#: Called inside the first run of ``paused`` before it writes: a test freezes it there.
PAUSE: list[Callable[[], None]] = []
_ids = itertools.count(1)


def _ran(name: str) -> int:
    RUNS[name] = RUNS.get(name, 0) + 1
    return RUNS[name]


@idempotent_view
def counter(request: HttpRequest) -> HttpResponse:
    run = _ran("counter")
    response = JsonResponse({"run": run, "id": next(_ids)}, status=201)
    response["Location"] = f"/things/{run}/"
    response["Set-Cookie"] = "secret=1"  # never stored, never replayed
    response["X-Internal"] = "not-allow-listed"
    return response


@idempotent_view(required=False)
def optional(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"run": _ran("optional")}, status=201)


@idempotent_view
def fails(request: HttpRequest) -> HttpResponse:
    run = _ran("fails")
    if run == 1:
        return HttpResponse("upstream down", status=503)
    return JsonResponse({"run": run}, status=201)


@idempotent_view
def raises(request: HttpRequest) -> HttpResponse:
    if _ran("raises") == 1:
        raise RuntimeError("boom")
    return JsonResponse({"ok": True}, status=201)


@idempotent_view
def streaming(request: HttpRequest) -> HttpResponseBase:
    _ran("streaming")
    return StreamingHttpResponse(iter([b"chunk-1,", b"chunk-2"]), content_type="text/plain")


@idempotent_view
def large(request: HttpRequest) -> HttpResponse:
    _ran("large")
    return HttpResponse(b"x" * 5000, content_type="text/plain", status=201)


@idempotent_view
def slow(request: HttpRequest) -> HttpResponse:
    run = _ran("slow")
    time.sleep(float(request.GET.get("sleep", "0")))
    return JsonResponse({"run": run}, status=201)


def _paused(name: str) -> Callable[[HttpRequest], HttpResponse]:
    def view(request: HttpRequest) -> HttpResponse:
        run = _ran(name)
        if run == 1 and PAUSE:
            PAUSE[0]()
        order = Order.objects.create(
            business_key=f"{name}-{run}-{next(_ids)}", amount=Decimal("1.00"), currency="CNY"
        )
        return JsonResponse({"run": run, "id": order.pk}, status=201)

    view.__name__ = name
    return view


paused = idempotent_view(_paused("paused"))
#: Outside a transaction of the decorator's (without ATOMIC_REQUESTS), as an async view.
paused_store = idempotent_view(on_failure="store")(_paused("paused_store"))


def _order(name: str, run: int) -> Order:
    return Order.objects.create(
        business_key=f"{name}-{run}-{next(_ids)}", amount=Decimal("1.00"), currency="CNY"
    )


def _writes_then_fails(name: str) -> Callable[[HttpRequest], HttpResponse]:
    """A view that creates an order on every run, then fails on its first: it answers
    502 (``?fail=raise``: raises) and, from its second run on, 201."""

    def view(request: HttpRequest) -> HttpResponse:
        run = _ran(name)
        order = _order(name, run)
        if run == 1:
            if request.GET.get("fail") == "raise":
                raise RuntimeError("boom after the write")
            return HttpResponse("bad gateway", status=502)
        return JsonResponse({"run": run, "id": order.pk}, status=201)

    view.__name__ = name
    return view


writes_then_fails = idempotent_view(_writes_then_fails("writes_then_fails"))
writes_then_fails_store = idempotent_view(on_failure="store")(
    _writes_then_fails("writes_then_fails_store")
)


@idempotent_view
async def awrites_then_fails(request: HttpRequest) -> HttpResponse:
    run = _ran("awrites_then_fails")
    order = await Order.objects.acreate(
        business_key=f"awrites-{run}-{next(_ids)}", amount=Decimal("1.00"), currency="CNY"
    )
    if run == 1:
        if request.GET.get("fail") == "raise":
            raise RuntimeError("boom after the write")
        return HttpResponse("bad gateway", status=502)
    return JsonResponse({"run": run, "id": order.pk}, status=201)


# The same views, async: the decorator must keep the same promises on the event loop.


@idempotent_view
async def acounter(request: HttpRequest) -> HttpResponse:
    await asyncio.sleep(0)
    run = _ran("acounter")
    response = JsonResponse({"run": run, "id": next(_ids)}, status=201)
    response["Location"] = f"/things/{run}/"
    response["Set-Cookie"] = "secret=1"
    response["X-Internal"] = "not-allow-listed"
    return response


@idempotent_view(required=False)
async def aoptional(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"run": _ran("aoptional")}, status=201)


# Writes nothing: released on failure, as the sync one (an async view's default stores it).
@idempotent_view(on_failure="release")
async def afails(request: HttpRequest) -> HttpResponse:
    run = _ran("afails")
    if run == 1:
        return HttpResponse("upstream down", status=503)
    return JsonResponse({"run": run}, status=201)


# Writes nothing: released on failure, as the sync one (an async view's default stores it).
@idempotent_view(on_failure="release")
async def araises(request: HttpRequest) -> HttpResponse:
    if _ran("araises") == 1:
        raise RuntimeError("boom")
    return JsonResponse({"ok": True}, status=201)


@idempotent_view
async def aorder(request: HttpRequest) -> HttpResponse:
    """Creates an order on every run (no business key): only the key stands between
    concurrent copies and a second order."""
    run = _ran("aorder")
    await asyncio.sleep(float(request.GET.get("sleep", "0")))
    order = await Order.objects.acreate(
        business_key=f"aorder-{run}-{next(_ids)}", amount=Decimal("1.00"), currency="CNY"
    )
    return JsonResponse({"run": run, "id": order.pk}, status=201)


#: Set by the second request to ``rendezvous``: the first one waits for it.
RENDEZVOUS: dict[str, asyncio.Event] = {}


@idempotent_view
async def rendezvous(request: HttpRequest, name: str) -> HttpResponse:
    """``first`` waits until ``second`` has run: both keyed requests are in their
    views at once, which a server whose event loop were blocked could not do."""
    event = RENDEZVOUS.setdefault("event", asyncio.Event())
    if name == "first":
        await asyncio.wait_for(event.wait(), 30)
    else:
        event.set()
    return JsonResponse({"name": name, "run": _ran(name)}, status=201)


@idempotent_view
async def apaused(request: HttpRequest) -> HttpResponse:
    run = _ran("apaused")
    if run == 1 and PAUSE:
        await sync_to_async(PAUSE[0])()
    order = await Order.objects.acreate(
        business_key=f"apaused-{run}-{next(_ids)}", amount=Decimal("1.00"), currency="CNY"
    )
    return JsonResponse({"run": run, "id": order.pk}, status=201)


class AsyncCounterView(IdempotentMixin, View):
    async def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return JsonResponse({"run": _ran("acbv")}, status=201)


class CounterView(IdempotentMixin, View):
    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return JsonResponse({"run": _ran("cbv")}, status=201)


test_patterns = [
    path("counter/", counter),
    path("optional/", optional),
    path("fails/", fails),
    path("raises/", raises),
    path("streaming/", streaming),
    path("large/", large),
    path("slow/", csrf_exempt(slow)),
    path("paused/", paused),
    path("paused_store/", paused_store),
    path("writes_then_fails/", writes_then_fails),
    path("writes_then_fails_store/", writes_then_fails_store),
    path("awrites_then_fails/", awrites_then_fails),
    path("acounter/", acounter),
    path("apaused/", apaused),
    path("aoptional/", aoptional),
    path("afails/", afails),
    path("araises/", araises),
    path("aorder/", csrf_exempt(aorder)),
    path("rendezvous/<str:name>/", csrf_exempt(rendezvous)),
    path("acbv/", AsyncCounterView.as_view()),
    path("cbv/", CounterView.as_view()),
]

try:
    import uuid

    from rest_framework import serializers, viewsets
    from rest_framework.decorators import action
    from rest_framework.response import Response
    from rest_framework.routers import DefaultRouter
    from rest_framework.views import APIView

    from idempotent_orders.contrib.drf import IdempotentAPIViewMixin

    class DrfCounter(IdempotentAPIViewMixin, APIView):
        def post(self, request: Any) -> Response:
            return Response({"run": _ran("drf"), "echo": request.data}, status=201)

    class OrderSerializer(serializers.ModelSerializer):
        class Meta:
            model = Order
            fields = ["id", "amount", "currency", "status"]
            read_only_fields = ["status"]

    class OrderViewSet(IdempotentAPIViewMixin, viewsets.ModelViewSet):
        """Every create makes a new order (no business key): only the key dedups."""

        queryset = Order.objects.order_by("pk")
        serializer_class = OrderSerializer

        def perform_create(self, serializer: Any) -> None:
            _ran("viewset-create")
            serializer.save(business_key=f"drf-{uuid.uuid4().hex}")

        @action(detail=True, methods=["post"])
        def cancel(self, request: Any, pk: str) -> Response:
            _ran("viewset-cancel")
            return Response({"cancelled": pk}, status=200)

    router = DefaultRouter()
    router.register("orders", OrderViewSet, basename="drf-order")
    test_patterns += [path("drf/", DrfCounter.as_view()), path("drf/router/", include(router.urls))]
except ImportError:  # the drf extra is not installed
    pass

try:
    from ninja import NinjaAPI, Schema

    from idempotent_orders.contrib.ninja import idempotent_operation

    ninja_api = NinjaAPI(urls_namespace="tests-ninja")

    class ThingIn(Schema):
        name: str

    @ninja_api.post("/things")
    @idempotent_operation
    def make_thing(request: HttpRequest, payload: ThingIn) -> Any:
        return {"run": _ran("ninja"), "name": payload.name}

    @ninja_api.post("/athings")
    @idempotent_operation
    async def amake_thing(request: HttpRequest, payload: ThingIn) -> Any:
        await asyncio.sleep(float(request.GET.get("sleep", "0")))
        return {"run": _ran("aninja"), "name": payload.name}

    @ninja_api.get("/things")
    @idempotent_operation
    def list_things(request: HttpRequest) -> Any:
        return {"runs": RUNS.get("ninja", 0)}

    test_patterns.append(path("ninja/", ninja_api.urls))
except ImportError:  # django-ninja is not installed
    pass

urlpatterns = [*demo_urlpatterns, path("t/", include(test_patterns))]
