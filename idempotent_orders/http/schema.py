"""The OpenAPI 3.1 description of the app's own API (``GET <prefix>/schema/``).

Written by hand, next to the views it describes; ``tests/http/test_http_schema.py``
holds it to the URLconf (every route described, every described method
allowed, every other method 405) and to the answers the views give.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from idempotent_orders import __version__
from idempotent_orders.models import OrderStatus

__all__ = [
    "KEY_PROBLEMS",
    "MAX_ITEMS",
    "MAX_QUANTITY",
    "PROBLEM_SCHEMA",
    "PROBLEM_TITLES",
    "openapi",
]

#: The most items an order takes, and the largest quantity of one: the views
#: enforce them, and the document states them (both import them from here).
MAX_ITEMS = 100
MAX_QUANTITY = 10_000

PROBLEM = "application/problem+json"

#: An RFC 9457 problem as the app answers it.
PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "title", "status", "code"],
    "properties": {
        "type": {"type": "string", "format": "uri"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "code": {"type": "string"},
        "detail": {"type": "string"},
    },
}
#: The problems any keyed operation may answer, whatever its view does.
KEY_PROBLEMS = (400, 403, 409, 413, 422, 429)


def _ref(kind: str, name: str) -> dict[str, str]:
    return {"$ref": f"#/components/{kind}/{name}"}


def _problems(*statuses: int) -> dict[str, Any]:
    return {str(status): _ref("responses", f"Problem{status}") for status in statuses}


PROBLEM_TITLES = {
    400: "Bad request: the key, the body or a field is invalid",
    401: "Authentication required",
    403: "The token was not issued to the caller, has expired or was used elsewhere",
    404: "No such resource (or not the caller's)",
    405: "Method not allowed (see the Allow header)",
    409: "A request with this key is still being processed; retry after Retry-After",
    413: "The request body is over MAX_REQUEST_BYTES",
    415: "Send Content-Type: application/json",
    422: "The key was first used with a different request",
    429: "Too many live keys or unused tokens; retry after Retry-After",
}

_RETRY_AFTER = {"Retry-After": {"schema": {"type": "string"}, "description": "Seconds."}}
_REPLAYED = {
    "Idempotent-Replayed": {
        "schema": {"type": "string", "enum": ["true"]},
        "description": "Present on a stored response replayed for a retried key.",
    }
}


def _problem_response(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": PROBLEM_TITLES[status],
        "content": {PROBLEM: {"schema": _ref("schemas", "Problem")}},
    }
    if status in (409, 429):
        response["headers"] = dict(_RETRY_AFTER)
    if status == 405:
        response["headers"] = {"Allow": {"schema": {"type": "string"}}}
    return response


def openapi(server: str = "/api") -> dict[str, Any]:
    """The document, for the app's URLs included under ``server`` (e.g. ``/api``)."""
    order = {
        "type": "object",
        "required": ["id", "status", "version"],
        "properties": {
            "id": {"type": "integer"},
            # The order model's own states (it may be swapped): a string, not an enum.
            "status": {"type": "string", "examples": [OrderStatus.PENDING_PAYMENT.value]},
            "amount": {"type": "string", "examples": ["12.50"]},
            "currency": {"type": "string", "examples": ["CNY"]},
            "version": {"type": "integer", "minimum": 0},
        },
    }
    new_order = {
        "type": "object",
        "required": ["amount", "currency", "items"],
        "properties": {
            "amount": {
                "type": "string",
                "description": "Positive, at most two decimal places, under 1e10.",
                "pattern": r"^[0-9]{1,10}(\.[0-9]{1,2})?$",
                "examples": ["12.50"],
            },
            "currency": {"type": "string", "pattern": "^[A-Z]{3}$", "examples": ["CNY"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_ITEMS,
                "items": {
                    "type": "object",
                    "required": ["sku", "quantity"],
                    "properties": {
                        "sku": {"type": "string", "minLength": 1, "maxLength": 64},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": MAX_QUANTITY},
                    },
                },
            },
        },
    }
    json_body = {"application/json": {"schema": _ref("schemas", "Order")}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "idempotent_orders",
            "version": __version__,
            "description": (
                "Orders created at most once per Idempotency-Key, and one-time tokens "
                "to use as keys. Errors are application/problem+json (RFC 9457)."
            ),
        },
        "servers": [{"url": server}],
        "security": [{"session": []}],
        "paths": {
            "/idempotency-tokens/": {
                "post": {
                    "operationId": "issue_token",
                    "summary": "A one-time token for the caller, to send as the Idempotency-Key",
                    "requestBody": {
                        "required": False,
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    "responses": {
                        "201": {
                            "description": "The token",
                            "content": {"application/json": {"schema": _ref("schemas", "Token")}},
                        },
                        **_problems(401, 413, 415, 429),
                    },
                }
            },
            "/orders/": {
                "post": {
                    "operationId": "create_order",
                    "summary": "Create the caller's order, at most once per key",
                    "parameters": [_ref("parameters", "IdempotencyKey")],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _ref("schemas", "NewOrder")}},
                    },
                    "responses": {
                        "201": {
                            "description": "Created (or the stored answer to this key, replayed)",
                            "headers": {
                                "Location": {
                                    "schema": {"type": "string"},
                                    "required": True,
                                    "description": "The order's URL.",
                                },
                                **_REPLAYED,
                            },
                            "content": json_body,
                        },
                        "200": {
                            "description": (
                                "The same basket was already ordered in this time window "
                                "(business key): that order"
                            ),
                            "headers": dict(_REPLAYED),
                            "content": json_body,
                        },
                        **_problems(400, 401, 403, 409, 413, 415, 422, 429),
                    },
                }
            },
            "/orders/{pk}/": {
                "get": {
                    "operationId": "read_order",
                    "summary": "The order, to its customer or staff",
                    "parameters": [
                        {
                            "name": "pk",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "integer", "minimum": 1},
                        }
                    ],
                    "responses": {
                        "200": {"description": "The order", "content": json_body},
                        **_problems(401, 404),
                    },
                }
            },
            "/schema/": {
                "get": {
                    "operationId": "schema",
                    "summary": "This document",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "OpenAPI 3.1",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "securitySchemes": {
                "session": {
                    "type": "apiKey",
                    "in": "cookie",
                    "name": settings.SESSION_COOKIE_NAME,
                    "description": "Django's session cookie (log in first).",
                }
            },
            "parameters": {
                "IdempotencyKey": {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": True,
                    "description": (
                        'An sf-string ("abc") or a bare key (abc): printable ASCII, 1 to '
                        "KEY_MAX_LENGTH characters; or a token from /idempotency-tokens/."
                    ),
                    "schema": {"type": "string", "minLength": 1, "maxLength": 257},
                }
            },
            "schemas": {
                "Order": order,
                "NewOrder": new_order,
                "Token": {
                    "type": "object",
                    "required": ["token", "expires_at"],
                    "properties": {
                        "token": {"type": "string"},
                        "expires_at": {"type": "string", "format": "date-time"},
                    },
                },
                "Problem": PROBLEM_SCHEMA,
            },
            "responses": {
                f"Problem{status}": _problem_response(status) for status in sorted(PROBLEM_TITLES)
            },
        },
    }
