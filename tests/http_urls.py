"""Demo URLs plus small views that exercise the idempotency machinery in tests."""

from __future__ import annotations

import itertools
import time
from typing import Any

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
from idempotent_orders.http.keys import IdempotentMixin, idempotent

#: How many times each test view body ran, by name.
RUNS: dict[str, int] = {}
_ids = itertools.count(1)


def _ran(name: str) -> int:
    RUNS[name] = RUNS.get(name, 0) + 1
    return RUNS[name]


@idempotent
def counter(request: HttpRequest) -> HttpResponse:
    run = _ran("counter")
    response = JsonResponse({"run": run, "id": next(_ids)}, status=201)
    response["Location"] = f"/things/{run}/"
    response["Set-Cookie"] = "secret=1"  # never stored, never replayed
    response["X-Internal"] = "not-allow-listed"
    return response


@idempotent(required=False)
def optional(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"run": _ran("optional")}, status=201)


@idempotent
def fails(request: HttpRequest) -> HttpResponse:
    run = _ran("fails")
    if run == 1:
        return HttpResponse("upstream down", status=503)
    return JsonResponse({"run": run}, status=201)


@idempotent
def raises(request: HttpRequest) -> HttpResponse:
    if _ran("raises") == 1:
        raise RuntimeError("boom")
    return JsonResponse({"ok": True}, status=201)


@idempotent
def streaming(request: HttpRequest) -> HttpResponseBase:
    _ran("streaming")
    return StreamingHttpResponse(iter([b"chunk-1,", b"chunk-2"]), content_type="text/plain")


@idempotent
def large(request: HttpRequest) -> HttpResponse:
    _ran("large")
    return HttpResponse(b"x" * 5000, content_type="text/plain", status=201)


@idempotent
def slow(request: HttpRequest) -> HttpResponse:
    run = _ran("slow")
    time.sleep(float(request.GET.get("sleep", "0")))
    return JsonResponse({"run": run}, status=201)


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
    path("cbv/", CounterView.as_view()),
]

try:
    from rest_framework.response import Response
    from rest_framework.views import APIView

    from idempotent_orders.http.drf import IdempotentAPIViewMixin

    class DrfCounter(IdempotentAPIViewMixin, APIView):
        def post(self, request: Any) -> Response:
            return Response({"run": _ran("drf"), "echo": request.data}, status=201)

    test_patterns.append(path("drf/", DrfCounter.as_view()))
except ImportError:  # the drf extra is not installed
    pass

urlpatterns = [*demo_urlpatterns, path("t/", include(test_patterns))]
