"""What a person sees, at a laptop's 1280x800 and a desktop's 1920x1080, in headless
Chromium: the boxes of what matters inside the window, not only in the HTML.

The pictures go to ``IO_TEST_SCREENSHOTS`` (docs/operations.md shows copies of the
1280 ones; `make screenshots` refreshes them)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from demo_project import warehouse
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.fulfilment import fulfil, fulfilment_message_id
from idempotent_orders.models import Order, ProcessedMessage
from tests.admin.test_operator_browser import login, operator
from tests.support.browser import (
    CHROMIUM,
    LAUNCH_ARGS,
    SCREENSHOTS,
    require_chromium,
    serve_static,
)
from tests.support.messages import payment

pytestmark = [
    pytest.mark.backends("postgresql", "mysql"),
    pytest.mark.services,
    pytest.mark.browser,
]

VIEWPORTS = [(1280, 800), (1920, 1080)]
#: One time format on every page: "2026-11-28 18:49:13".
TIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d$")


def inside(box: dict[str, float] | None, width: int, height: int) -> bool:
    """The box is wholly inside the window (the page scrolled to its top)."""
    return (
        box is not None
        and box["x"] >= 0
        and box["y"] >= 0
        and box["x"] + box["width"] <= width
        and box["y"] + box["height"] <= height
    )


def shot(page: Any, name: str, width: int) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}-{width}.png"))


@pytest.fixture
def refused_order(make_order: Any) -> Order:
    """A paid order whose warehouse refused twice: refused, not stuck."""
    order = make_order()
    consume_message(payment(order), consumer="payments")
    warehouse.script(order.pk, "fail", "fail")
    fulfil(order.pk)
    operator()
    return order


@pytest.mark.parametrize(("width", "height"), VIEWPORTS)
def test_the_operator_sees_the_refused_order_its_reason_and_its_fix_on_the_first_screen(
    live_server: Any, refused_order: Order, width: int, height: int
) -> None:
    sync_api = require_chromium()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.route("**/static/**", serve_static)
            login(page, live_server.url)
            counts = {
                key: page.text_content(f"#attention-{key} td.count") for key in ("refused", "stuck")
            }
            index = {
                cell: page.locator(f"#attention-refused {cell}").bounding_box()
                for cell in ("th", "td.count", "td.note")
            }
            shot(page, "admin-index", width)
            with page.expect_navigation():
                page.click("#attention-refused td.count a")
            listed = {
                what: page.locator(f"#result_list {what}").first.bounding_box()
                for what in (".io-reason", "a.io-fix", "th.field-message_id")
            }
            reason = page.text_content("#result_list .io-reason")
            shot(page, "admin-refused-list", width)
        finally:
            browser.close()
    assert counts == {"refused": "1", "stuck": "0"}
    for cell, box in index.items():
        assert inside(box, width, height), cell
    # A label reads across (one or two lines), not a word a line.
    assert index["th"] is not None
    assert index["th"]["height"] < 60
    for what, box in listed.items():
        assert inside(box, width, height), what
    assert reason == "WarehouseError: the warehouse refused the request"


@pytest.mark.parametrize(("width", "height"), VIEWPORTS)
def test_the_order_page_keeps_every_attempt_in_one_time_format(
    live_server: Any, refused_order: Order, width: int, height: int
) -> None:
    from idempotent_orders import reconcile

    sync_api = require_chromium()
    row = ProcessedMessage.objects.get(message_id=fulfilment_message_id(refused_order.pk))
    assert reconcile.retry(row.pk).value == "retry"  # refused a second time
    assert reconcile.retry(row.pk).value == "completed"  # the fix
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.route("**/static/**", serve_static)
            login(page, live_server.url)
            page.goto(f"{live_server.url}/admin/idempotent_orders/order/{refused_order.pk}/change/")
            created = page.text_content(".field-created_at .readonly") or ""
            whens = page.locator("#timeline td.when").all_text_contents()
            attempts = page.locator("#timeline tr[data-kind=attempt]").evaluate_all(
                "rows => rows.map(r => r.dataset.outcome)"
            )
            text = page.text_content("body") or ""
            page.locator("#timeline").scroll_into_view_if_needed()
            last = page.locator("#timeline tr[data-kind=attempt]").last
            last.scroll_into_view_if_needed()
            box = last.locator("td.outcome").bounding_box()
            viewport_box = page.evaluate("({w: window.innerWidth, h: window.innerHeight})")
            # The box is relative to the scrolled window.
            shot(page, "admin-order-timeline", width)
        finally:
            browser.close()
    assert TIME.match(created.strip()), created
    assert whens
    assert all(TIME.match(w.strip()) for w in whens), whens
    assert not re.search(r"\b[ap]\.m\.", text)
    assert attempts == ["refused", "refused", "completed"]
    assert box is not None
    assert box["x"] + box["width"] <= viewport_box["w"]
    assert 0 <= box["y"] <= viewport_box["h"]


@pytest.mark.parametrize(("width", "height"), VIEWPORTS)
def test_the_customer_finds_their_orders_and_is_offered_one_payment(
    live_server: Any, width: int, height: int
) -> None:
    sync_api = require_chromium()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.route("**/static/**", serve_static)
            page.goto(f"{live_server.url}/shop/")
            link = page.locator("#your-orders").bounding_box()
            page.fill("#qty-tea-longjing", "1")
            with page.expect_navigation():
                page.click("#pay")
            page.locator("#order").wait_for()
            order_id = int(page.get_attribute("#order", "data-order-id") or 0)
            pay = page.locator("#pay").bounding_box()
            with page.expect_navigation():
                page.click("#your-orders")
            row = page.locator(f"#orders tr[data-order-id='{order_id}']")
            listed = row.bounding_box()
            placed = row.locator("td.when").text_content() or ""
            shot(page, "shop-your-orders", width)
            # Paid meanwhile: the order page offers no second payment.
            from tests.admin.test_operator_browser import outside_the_loop

            outside_the_loop(
                lambda: consume_message(
                    payment(Order.objects.get(pk=order_id)), consumer="payments"
                )
            )
            with page.expect_navigation():
                row.locator("a").click()
            status = page.text_content("#status") or ""
            pay_after = page.locator("#pay").count()
            shot(page, "shop-order-paid", width)
        finally:
            browser.close()
    assert inside(link, width, height)
    assert inside(pay, width, height)
    assert inside(listed, width, height)
    assert TIME.match(placed.strip()), placed
    assert status.strip() != "pending payment"
    assert pay_after == 0
