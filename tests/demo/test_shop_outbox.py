"""The demo checkout publishes its follow-up through the outbox, once per order created."""

from __future__ import annotations

import http.client
import re
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest
from django.test import Client

from demo_project.tasks import award_points
from idempotent_orders.http.forms import FORM_FIELD
from idempotent_orders.models import Order, OutboxMessage, OutboxStatus
from tests.support.http import together


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []

    def apply_async(args: Any = None, task_id: str | None = None, **options: Any) -> None:
        calls.append((task_id, args[0]))

    monkeypatch.setattr(award_points, "apply_async", apply_async)
    return calls


def token(client: Client) -> str:
    html = client.get("/shop/").content.decode()
    found = re.search(rf'name="{FORM_FIELD}" value="([^"]+)"', html)
    assert found, html
    return found.group(1)


def submit(client: Client, form_token: str) -> Any:
    return client.post("/shop/checkout/", {"qty-pot-yixing": "1", FORM_FIELD: form_token})


@pytest.mark.django_db
def test_double_submit_creates_one_order_and_one_outbox_row(
    sent: list[Any], django_capture_on_commit_callbacks: Any
) -> None:
    client = Client()
    first_token = token(client)
    with django_capture_on_commit_callbacks(execute=True):
        first = submit(client, first_token)
        again = submit(client, first_token)  # the same form posted twice
        other_tab = submit(client, token(client))  # the same basket from a second page
    assert first.status_code == again.status_code == other_tab.status_code == 303
    assert first["Location"] == again["Location"] == other_tab["Location"]
    order = Order.objects.get()
    row = OutboxMessage.objects.get()
    customer = f"session-{client.session.session_key}"
    assert (row.message_id, row.status) == (f"order-points-{order.pk}", OutboxStatus.SENT)
    assert sent == [
        (row.message_id, {"message_id": row.message_id, "customer": customer} | {"points": 320})
    ]


@pytest.mark.django_db
def test_a_rejected_basket_queues_nothing(sent: list[Any]) -> None:
    client = Client()
    assert client.post("/shop/checkout/", {FORM_FIELD: token(client)}).status_code == 400
    assert not OutboxMessage.objects.exists()


def page(base: str, cookies: dict[str, str]) -> tuple[str, str]:
    """GET the shop like a browser: keep its cookies; return (form token, CSRF token)."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("GET", "/shop/", headers={"Cookie": cookie_header(cookies)})
        response = conn.getresponse()
        for header, value in response.getheaders():
            if header.lower() == "set-cookie":
                name, _, rest = value.partition("=")
                cookies[name] = rest.split(";", 1)[0]
        html = response.read().decode()
    finally:
        conn.close()
    form = re.search(rf'name="{FORM_FIELD}" value="([^"]+)"', html)
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)
    assert form, html
    assert csrf, html
    return form.group(1), csrf.group(1)


def cookie_header(cookies: dict[str, str]) -> str:
    return "; ".join(f"{k}={v}" for k, v in cookies.items())


def post_form(base: str, cookies: dict[str, str], form_token: str, csrf: str) -> int:
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        body = urlencode(
            {"qty-cup-celadon": "2", FORM_FIELD: form_token, "csrfmiddlewaretoken": csrf}
        )
        conn.request(
            "POST",
            "/shop/checkout/",
            body=body,
            headers={
                "Content-Type": "application/x-www-form-urlencoded",
                "Cookie": cookie_header(cookies),
            },
        )
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.services
def test_concurrent_submits_from_two_tabs_queue_one_follow_up(
    live_server: Any, settings: Any
) -> None:
    """Two pages of one session submit the same basket at the same instant, five times each."""
    settings.IDEMPOTENT_ORDERS = {**settings.IDEMPOTENT_ORDERS, "OUTBOX_PUBLISH_ON_COMMIT": False}
    cookies: dict[str, str] = {}
    tabs = [page(live_server.url, cookies) for _ in range(2)]
    assert "sessionid" in cookies, cookies
    statuses = together(10, lambda i: post_form(live_server.url, cookies, *tabs[i % 2]))
    assert statuses == [303] * 10
    order = Order.objects.get()
    assert list(OutboxMessage.objects.values_list("message_id", flat=True)) == [
        f"order-points-{order.pk}"
    ]
