"""In headless Chromium: the operator fixes a stuck order from /admin/ in three clicks and
reads an order's timeline; the customer's expired form is said and offered again.
Screenshots go to docs/img/ (shown on docs/operations.md)."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from demo_project import warehouse
from idempotent_orders.fulfilment import fulfil, fulfilment_message_id
from idempotent_orders.models import IdempotencyKey, Order, OrderStatus, ProcessedMessage
from tests.admin.test_admin_timeline import journey
from tests.support.browser import (
    CHROMIUM,
    LAUNCH_ARGS,
    SCREENSHOTS,
    require_chromium,
    serve_static,
)

pytestmark = [
    pytest.mark.backends("postgresql", "mysql"),
    pytest.mark.services,
    pytest.mark.browser,
]

#: The pictures of docs/operations.md are copies of these (never written there by a test run).
IMG = SCREENSHOTS


def operator() -> None:
    """The operator's login (made before Playwright's loop runs: no ORM inside it)."""
    get_user_model().objects.create_superuser("operator", "op@example.com", "operator-pw")


def outside_the_loop(work: Any) -> None:
    """Run ORM ``work`` from inside the Playwright block (its event loop forbids it there)."""
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def login(page: Any, base: str) -> None:
    page.goto(f"{base}/admin/login/?next=/admin/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", "operator-pw")
    with page.expect_navigation():
        page.click("input[type=submit]")


def test_operator_fixes_a_stuck_order_from_the_admin_index_in_three_clicks(
    live_server: Any, make_order: Any
) -> None:
    sync_api = require_chromium()
    from idempotent_orders.consuming.single import consume_message
    from tests.support.messages import payment

    order = make_order()
    consume_message(payment(order), consumer="payments")
    warehouse.script(order.pk, "lose_reply")  # the warehouse did it; its answer was lost
    fulfil(order.pk)
    row = ProcessedMessage.objects.get(message_id=fulfilment_message_id(order.pk))
    assert row.status == "processing"
    operator()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.route("**/static/**", serve_static)
            login(page, live_server.url)
            assert page.url == f"{live_server.url}/admin/"
            assert page.text_content("#attention-refused td.count") == "1"
            page.screenshot(path=str(IMG / "admin-index-attention.png"), full_page=True)
            # 1: the count; 2: the row's "Retry…"; 3: "Yes, I'm sure".
            with page.expect_navigation():
                page.click("#attention-refused td.count a")
            with page.expect_navigation():
                page.click("#result_list a.io-fix")
            assert "asks fulfilment first whether it already happened" in page.content()
            page.screenshot(path=str(IMG / "admin-retry-confirm.png"), full_page=True)
            with page.expect_navigation():
                page.click("#confirm")
            said = " ".join(page.locator("ul.messagelist li").all_text_contents())
            page.screenshot(path=str(IMG / "admin-retry-done.png"), full_page=True)
        finally:
            browser.close()
    assert "completed; now applied." in said
    assert "Nothing else needs attention now." in said
    assert Order.objects.get(pk=order.pk).status == OrderStatus.PROCESSING
    assert warehouse.effects(order.pk) == 1


def test_the_timeline_of_an_order_through_a_redelivery_a_park_and_a_retry(
    live_server: Any, make_order: Any
) -> None:
    sync_api = require_chromium()
    order, _ = journey(make_order)  # parked shipment, payment failed twice, outbox row
    failed = ProcessedMessage.objects.get(message_id="pay-1")
    operator()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.route("**/static/**", serve_static)
            login(page, live_server.url)
            page.goto(f"{live_server.url}/admin/idempotent_orders/order/{order.pk}/change/")
            assert page.locator("#timeline tr.attention").count() == 2  # failed, held
            page.locator("#timeline").scroll_into_view_if_needed()
            page.screenshot(path=str(IMG / "admin-timeline-before.png"), full_page=True)
            with page.expect_navigation():
                page.click(f"#timeline a.io-fix[href*='/{failed.pk}/confirm/retry/']")
            with page.expect_navigation():
                page.click("#confirm")
            # Back on the order, which is now shipped: its story, oldest first.
            assert page.url.endswith(f"/order/{order.pk}/change/")
            outcomes = page.locator("#timeline tbody tr").evaluate_all(
                "rows => rows.map(r => r.dataset.kind + ':' + r.dataset.outcome)"
            )
            page.screenshot(path=str(IMG / "admin-timeline.png"), full_page=True)
        finally:
            browser.close()
    assert outcomes[0] == "order:"
    assert outcomes.count("message:applied") == 2  # the payment, then the released shipment
    assert "operator:applied" in outcomes
    assert "outbox:pending" in outcomes
    assert Order.objects.get(pk=order.pk).status == OrderStatus.SHIPPED


def test_the_customer_s_expired_form_is_said_and_offered_again(live_server: Any) -> None:
    sync_api = require_chromium()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": 960, "height": 640})
            page.route("**/static/**", serve_static)
            page.goto(f"{live_server.url}/shop/")
            page.fill("#qty-tea-longjing", "2")
            # The customer left the page open too long: the token expired meanwhile.
            outside_the_loop(
                lambda: IdempotencyKey.objects.update(expires_at="2000-01-01T00:00:00Z")
            )
            with page.expect_navigation():
                page.click("#pay")
            problem = page.text_content("#problems") or ""
            kept = page.input_value("#qty-tea-longjing")
            page.screenshot(path=str(IMG / "shop-expired-form.png"), full_page=True)
            with page.expect_navigation():
                page.click("#pay")  # the fresh token the form came back with
            page.locator("#order").wait_for()
            status = page.text_content("#status")
            page.screenshot(path=str(IMG / "shop-order-status.png"), full_page=True)
        finally:
            browser.close()
    assert "expired" in problem
    assert kept == "2"
    assert re.fullmatch(r"\s*pending payment\s*", status or "", re.I)
    assert Order.objects.count() == 1
