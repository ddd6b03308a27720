"""The app's own API: its OpenAPI document held to the URLconf, problem+json errors, Location."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import URLPattern

from idempotent_orders.http import urls as app_urls
from idempotent_orders.models import Order

pytestmark = [pytest.mark.django_db]

ORDER = {"amount": "12.50", "currency": "CNY", "items": [{"sku": "tea", "quantity": 1}]}
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


@pytest.fixture
def client() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_user("alice", password="pw"))
    return client


def document(client: Client) -> dict[str, Any]:
    response = client.get("/api/schema/")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    doc: dict[str, Any] = json.loads(response.content)
    assert doc["openapi"].startswith("3.1.")
    assert doc["servers"] == [{"url": "/api"}]
    return doc


def route_of(pattern: URLPattern) -> str:
    """``orders/<str:pk>/`` -> ``/orders/{pk}/``, as OpenAPI spells a path."""
    route = str(pattern.pattern)
    while "<" in route:
        start, end = route.index("<"), route.index(">")
        route = route[:start] + "{" + route[start + 1 : end].split(":")[-1] + "}" + route[end + 1 :]
    return "/" + route


def problem(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/problem+json"
    data: dict[str, Any] = json.loads(response.content)
    assert (data["status"], data["code"]) == (status, code)
    return data


def test_every_route_is_described_with_exactly_its_methods(client: Client) -> None:
    doc = document(client)
    routes = {route_of(p): p for p in app_urls.urlpatterns if isinstance(p, URLPattern)}
    assert len(routes) == len(app_urls.urlpatterns)
    assert set(doc["paths"]) == set(routes)
    order = Order.objects.create(business_key="b", amount="1.00", currency="CNY")
    for route, operations in doc["paths"].items():
        url = "/api" + route.replace("{pk}", str(order.pk))
        described = {m.upper() for m in operations}
        for method in METHODS:
            response = client.generic(method, url, "{}", content_type="application/json")
            if method in described or (method == "HEAD" and "GET" in described):
                assert response.status_code != 405, (method, route)
                continue
            # Whatever the route does not describe, it refuses, as problem+json
            # (a HEAD answer has no body).
            if method == "HEAD":
                assert response.status_code == 405
                assert response["Content-Type"] == "application/problem+json"
            else:
                problem(response, 405, "method-not-allowed")
            allowed = {m.strip() for m in response["Allow"].split(",")} - {"HEAD"}
            assert allowed == described, (route, response["Allow"])


def test_every_described_operation_lists_the_problems_it_answers() -> None:
    from idempotent_orders.http.schema import openapi

    doc = openapi()
    for route, operations in doc["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if int(status) >= 400:
                    assert response["$ref"] == f"#/components/responses/Problem{status}"
            if operation.get("security") != []:
                assert "401" in operation["responses"], (method, route)


def test_405_is_problem_json(client: Client) -> None:
    response = client.get("/api/orders/")
    problem(response, 405, "method-not-allowed")
    assert response["Allow"] == "POST"
    problem(client.get("/api/idempotency-tokens/"), 405, "method-not-allowed")
    problem(client.post(f"/api/orders/{1}/"), 405, "method-not-allowed")


@pytest.mark.parametrize("pk", ["abc", "-1", "1.5", "99999999999999999999999", "٣"])
def test_a_malformed_or_huge_order_id_is_problem_json_404(client: Client, pk: str) -> None:
    problem(client.get(f"/api/orders/{pk}/"), 404, "not-found")


def test_413_and_415_are_problem_json(client: Client, settings: Any) -> None:
    settings.IDEMPOTENT_ORDERS = {"MAX_REQUEST_BYTES": 100}
    big = json.dumps({"pad": "x" * 200})
    for url in ("/api/idempotency-tokens/", "/api/orders/"):
        response = client.post(url, big, content_type="application/json", headers=KEY)
        problem(response, 413, "body-too-large")
        problem(client.post(url, {"a": "b"}, headers=KEY), 415, "unsupported-media-type")


KEY = {"Idempotency-Key": "k"}


def test_201_carries_location_and_replays_it(client: Client) -> None:
    first = client.post("/api/orders/", ORDER, content_type="application/json", headers=KEY)
    assert first.status_code == 201
    order = Order.objects.get()
    assert first["Location"] == f"/api/orders/{order.pk}/"
    assert json.loads(client.get(first["Location"]).content)["id"] == order.pk
    again = client.post("/api/orders/", ORDER, content_type="application/json", headers=KEY)
    assert (again["Idempotent-Replayed"], again["Location"]) == ("true", first["Location"])
    # The same basket under another key finds the order: 200, nothing created, no Location.
    found = client.post(
        "/api/orders/", ORDER, content_type="application/json", headers={"Idempotency-Key": "2"}
    )
    assert found.status_code == 200
    assert "Location" not in found
