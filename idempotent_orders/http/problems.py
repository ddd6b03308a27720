"""``application/problem+json`` responses (RFC 9457) for idempotency errors."""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpResponse

from idempotent_orders.exceptions import IdempotencyError

#: Problem types are ``<PROBLEM_TYPE_BASE><code>``, e.g. ``urn:idempotent-orders:key-mismatch``.
PROBLEM_TYPE_BASE = "urn:idempotent-orders:"


def problem_response(
    status: int, code: str, title: str, detail: str = "", **extra: Any
) -> HttpResponse:
    body: dict[str, Any] = {
        "type": PROBLEM_TYPE_BASE + code,
        "title": title,
        "status": status,
        "code": code,
    }
    if detail:
        body["detail"] = detail
    body.update(extra)
    return HttpResponse(json.dumps(body), status=status, content_type="application/problem+json")


def problem_from(exc: IdempotencyError) -> HttpResponse:
    response = problem_response(exc.status_code, exc.code, exc.title, exc.message)
    if exc.retry_after is not None:
        response["Retry-After"] = str(exc.retry_after)
    return response
