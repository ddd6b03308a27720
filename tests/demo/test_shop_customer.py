"""The customer's side of the demo shop: token problems said in words with a fresh form,
quantities never dropped silently, no blank 405, a live order status."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.test import Client

from idempotent_orders.consuming.single import consume_message
from idempotent_orders.http.forms import FORM_FIELD
from idempotent_orders.models import Order
from tests.support.messages import payment

pytestmark = pytest.mark.django_db
HTML = {"HTTP_ACCEPT": "text/html,application/xhtml+xml,*/*;q=0.8"}


def token_of(html: str) -> str:
    found = re.search(rf'name="{FORM_FIELD}" value="([^"]+)"', html)
    assert found, html
    return found.group(1)


def post(client: Client, data: dict[str, str], **headers: str) -> Any:
    return client.post("/shop/checkout/", data, **headers)


@pytest.mark.parametrize(
    ("token", "status", "words"),
    [
        (None, 400, "its one-time token was missing"),
        ("tok_forged-not-issued", 403, "This form had expired or was not ours"),
    ],
)
def test_a_token_problem_renders_the_form_again_for_a_browser(token, status, words) -> None:
    client = Client()
    client.get("/shop/")
    data = {"qty-tea-longjing": "2"}
    if token is not None:
        data[FORM_FIELD] = token
    page = post(client, data, **HTML)
    html = page.content.decode()
    assert page.status_code == status
    assert page["Content-Type"].startswith("text/html")
    assert words in html
    assert 'id="qty-tea-longjing" value="2"' in html  # what was typed is kept
    fresh = token_of(html)
    assert fresh != token
    # The fresh token places the order.
    assert post(client, {"qty-tea-longjing": "2", FORM_FIELD: fresh}).status_code == 303
    assert Order.objects.count() == 1


def test_an_api_client_keeps_problem_json() -> None:
    client = Client()
    answer = post(client, {"qty-tea-longjing": "2"}, HTTP_ACCEPT="application/json")
    assert answer.status_code == 400
    assert answer["Content-Type"] == "application/problem+json"


def test_an_expired_token_says_so(settings: Any) -> None:
    from idempotent_orders.models import IdempotencyKey

    client = Client()
    old = token_of(client.get("/shop/").content.decode())
    IdempotencyKey.objects.filter(key=old).update(expires_at="2000-01-01T00:00:00Z")
    page = post(client, {"qty-cup-celadon": "1", FORM_FIELD: old}, **HTML)
    assert page.status_code == 403
    assert "expired" in page.content.decode()
    assert not Order.objects.exists()


@pytest.mark.parametrize(
    ("quantities", "said"),
    [
        ({"tea-longjing": "-3", "cup-celadon": "3"}, "-3 is below zero"),
        ({"pot-yixing": "150"}, "150 is more than the 99 one order can take"),
        ({"pot-yixing": "two"}, "is not a number of items"),
        ({}, "Choose at least one item."),
    ],
)
def test_a_wrong_quantity_is_said_never_dropped(quantities: dict[str, str], said: str) -> None:
    client = Client()
    fresh = token_of(client.get("/shop/").content.decode())
    data = {f"qty-{sku}": n for sku, n in quantities.items()} | {FORM_FIELD: fresh}
    page = post(client, data, **HTML)
    assert page.status_code == 400
    assert said in page.content.decode()
    assert not Order.objects.exists()  # "-3 tea, 3 cups" does not become "3 cups"


def test_get_checkout_goes_back_to_the_shop() -> None:
    answer = Client().get("/shop/checkout/")
    assert (answer.status_code, answer["Location"]) == (303, "/shop/")


def test_the_order_page_polls_its_live_status() -> None:
    client = Client()
    fresh = token_of(client.get("/shop/").content.decode())
    placed = post(client, {"qty-cup-celadon": "1", FORM_FIELD: fresh})
    order = Order.objects.get()
    page = client.get(placed["Location"]).content.decode()
    assert f"/shop/orders/{order.pk}/status.json" in page
    assert '<noscript><meta http-equiv="refresh"' in page
    status = json.loads(client.get(f"/shop/orders/{order.pk}/status.json").content)
    assert (status["status"], status["final"]) == ("pending_payment", False)
    consume_message(payment(order), consumer="payments")
    status = json.loads(client.get(f"/shop/orders/{order.pk}/status.json").content)
    assert (status["status"], status["label"]) == ("paid", "paid")
    # Someone else's order is not found.
    assert Client().get(f"/shop/orders/{order.pk}/status.json").status_code == 404


def test_the_demo_prints_its_admin_login(tmp_path: Any, settings: Any) -> None:
    from io import StringIO

    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    settings.STATE_DIR = tmp_path
    out = StringIO()
    call_command("demo_superuser", stdout=out)
    said = out.getvalue()
    password = re.search(r"user admin, password (\S+);", said)
    assert password is not None, said
    assert get_user_model().objects.get(username="admin").check_password(password.group(1))
    again = StringIO()
    call_command("demo_superuser", stdout=again)
    assert again.getvalue() == said  # the same login, not a new one


def place_order(client: Client) -> tuple[int, str]:
    """An order placed through the shop's form: its id and its page."""
    token = token_of(client.get("/shop/").content.decode())
    placed = post(client, {"qty-tea-longjing": "2", FORM_FIELD: token})
    assert placed.status_code == 303
    url = placed["Location"]
    return int(url.rstrip("/").rsplit("/", 1)[1]), url


def test_a_double_click_on_pay_charges_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """FakePay's Pay form carries a one-time token: the second click of a double click
    lands on the first click's result, and the provider charges (sends) once."""
    from demo_project import payments

    charges: list[str] = []

    def deliver(url: str, body: bytes, headers: dict[str, str]) -> int:
        charges.append(json.loads(body)["data"]["object"]["id"])
        return 200

    monkeypatch.setattr(payments, "deliver", deliver)
    monkeypatch.setattr(payments, "signed", lambda event: (json.dumps(event).encode(), {}))
    client = Client()
    pk, order_url = place_order(client)
    page = client.get(f"/shop/orders/{pk}/pay/", **HTML)
    form = {"deliveries": "1", FORM_FIELD: token_of(page.content.decode())}
    first = client.post(f"/shop/orders/{pk}/pay/", form, **HTML)
    second = client.post(f"/shop/orders/{pk}/pay/", form, **HTML)
    assert (first.status_code, second.status_code) == (303, 303)
    assert first["Location"] == second["Location"] == order_url
    assert len(charges) == 1
    # What FakePay did is said on the order page it redirects to.
    shown = client.get(order_url, **HTML).content.decode()
    assert "FakePay sent the payment webhook 1 time(s)" in shown


def test_a_paid_order_offers_no_pay_button() -> None:
    from idempotent_orders.consuming.running import apply_transition

    client = Client()
    pk, order_url = place_order(client)
    assert 'id="pay"' in client.get(order_url, **HTML).content.decode()
    assert apply_transition(Order.objects.get(pk=pk), "pay").applied
    assert 'id="pay"' not in client.get(order_url, **HTML).content.decode()
    again = client.get(f"/shop/orders/{pk}/pay/", follow=True, **HTML)
    assert "does not await a payment" in again.content.decode()
