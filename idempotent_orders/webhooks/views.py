"""The webhook endpoint: ``POST <prefix>/<provider>/`` with the provider's signed body."""

from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from idempotent_orders.http.problems import problem_response
from idempotent_orders.webhooks.ingress import receive


@csrf_exempt
@require_POST
def webhook(request: HttpRequest, provider: str) -> HttpResponse:
    """Verify and store the event, answer 200 (or a problem+json 4xx, recorded)."""
    receipt = receive(provider, request.body, request.headers)
    if receipt.code:
        return problem_response(
            receipt.status, receipt.code, receipt.title, receipt.detail, provider=provider[:64]
        )
    return HttpResponse(
        json.dumps(receipt.body), status=receipt.status, content_type="application/json"
    )
