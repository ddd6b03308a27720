"""drf-spectacular: keyed operations carry the key's header parameter and problem responses."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import include, path

from tests.support.services import unavailable


@pytest.fixture
def spectacular_schema(settings: Any) -> dict[str, Any]:
    try:
        from drf_spectacular.generators import SchemaGenerator

        import idempotent_orders.contrib.spectacular  # noqa: F401  (registers the extension)
    except ImportError:
        unavailable("drf-spectacular is not installed", hint="pip install --group test")
    from tests.http_urls import DrfCounter, router

    settings.REST_FRAMEWORK = {"DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema"}
    patterns = [path("drf/", DrfCounter.as_view()), path("drf/router/", include(router.urls))]
    schema: dict[str, Any] = SchemaGenerator(patterns=patterns).get_schema(None, public=True)
    return schema


def header_params(operation: dict[str, Any]) -> dict[str, Any]:
    return {p["name"]: p for p in operation.get("parameters", []) if p["in"] == "header"}


def test_keyed_operations_are_described(spectacular_schema: dict[str, Any]) -> None:
    paths = spectacular_schema["paths"]
    keyed = [
        ("/drf/", "post"),
        ("/drf/router/orders/", "post"),
        ("/drf/router/orders/{id}/", "put"),
        ("/drf/router/orders/{id}/", "patch"),
        ("/drf/router/orders/{id}/", "delete"),
        ("/drf/router/orders/{id}/cancel/", "post"),
    ]
    for route, method in keyed:
        operation = paths[route][method]
        assert header_params(operation)["Idempotency-Key"]["required"] is True, (route, method)
        responses = operation["responses"]
        for status in ("400", "403", "409", "413", "422", "429"):
            content = responses[status]["content"]["application/problem+json"]
            assert content["schema"] == {"$ref": "#/components/schemas/IdempotencyProblem"}
        for status, response in responses.items():
            if status.startswith("2"):
                assert "Idempotent-Replayed" in response["headers"], (route, method, status)
    create = paths["/drf/router/orders/"]["post"]["responses"]
    assert "201" in create
    assert "Problem" not in str(create["201"])
    problem = spectacular_schema["components"]["schemas"]["IdempotencyProblem"]
    assert problem["required"] == ["type", "title", "status", "code"]


def test_safe_operations_are_left_alone(spectacular_schema: dict[str, Any]) -> None:
    paths = spectacular_schema["paths"]
    for route, method in [("/drf/router/orders/", "get"), ("/drf/router/orders/{id}/", "get")]:
        operation = paths[route][method]
        assert "Idempotency-Key" not in header_params(operation)
        assert "409" not in operation["responses"]
