"""The webhook endpoint: ``POST <prefix>/<provider>/`` with the provider's signed body."""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from idempotent_orders.conf import conf
from idempotent_orders.http.problems import problem_response
from idempotent_orders.webhooks.ingress import REFUSED_BODY_EXCERPT, receive


def read_body(request: HttpRequest) -> tuple[bytes, int | None]:
    """The raw body, read from the stream under the app's own limit, and the length the
    request declared (None when it declared none).

    ``request.body`` is not used: past ``DATA_UPLOAD_MAX_MEMORY_SIZE`` it raises before
    the app could answer its own 413 problem, and it reads a body of any size into
    memory. Here a body declared over ``MAX_REQUEST_BYTES`` is not read past an excerpt,
    and one that declares nothing (or less than it sends) is read up to one byte past
    the limit, so its size is known to be too large. A body some middleware already
    read is taken as it was read.
    """
    already = getattr(request, "_body", None)
    if isinstance(already, bytes):
        return already, len(already)
    try:
        declared: int | None = int(request.META.get("CONTENT_LENGTH") or "")
    except ValueError:
        declared = None
    if declared is not None and declared < 0:
        declared = None
    limit = conf.MAX_REQUEST_BYTES
    if declared is not None and declared > limit:
        return request.read(REFUSED_BODY_EXCERPT), declared
    return request.read(limit + 1), declared


@csrf_exempt
@require_POST
def webhook(request: HttpRequest, provider: str) -> HttpResponse:
    """Verify and store the event, answer 200 (or a problem+json 4xx, recorded)."""
    body, declared = read_body(request)
    receipt = receive(
        provider,
        body,
        request.headers,
        address=str(request.META.get("REMOTE_ADDR") or ""),
        length=declared,
    )
    if receipt.code:
        response = problem_response(
            receipt.status, receipt.code, receipt.title, receipt.detail, provider=provider[:64]
        )
        if receipt.retry_after is not None:
            response["Retry-After"] = str(receipt.retry_after)
        return response
    return HttpResponse(
        json.dumps(receipt.body), status=receipt.status, content_type="application/json"
    )
