"""A double-clicked checkout in real headless Chromium creates one order (PRG)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.core.signals import request_started

from idempotent_orders.models import Order
from idempotent_orders.signals import idempotent_request
from tests.support.browser import (
    CHROMIUM,
    LAUNCH_ARGS,
    SCREENSHOTS,
    require_chromium,
    serve_static,
)
from tests.support.services import wait_until

pytestmark = [
    pytest.mark.backends("postgresql", "mysql"),
    pytest.mark.services,
    pytest.mark.browser,
]

#: The shop with a basket filled in; docs/img/shop.png is a copy.
SCREENSHOT = SCREENSHOTS / "shop.png"


def test_double_clicked_checkout_creates_one_order(live_server: Any, settings: Any) -> None:
    sync_api = require_chromium()
    # Hold the first submit open, so the second click's submit arrives while it runs.
    settings.DEMO_CHECKOUT_DELAY = 3.0
    outcomes: list[tuple[str, str]] = []
    lock = threading.Lock()

    def record(sender: Any, request: Any, key: str, outcome: str, **kwargs: Any) -> None:
        with lock:
            outcomes.append((key, outcome))

    arrived = threading.Event()

    def started(sender: Any, environ: dict[str, Any], **kwargs: Any) -> None:
        if environ.get("REQUEST_METHOD") == "POST":
            arrived.set()

    idempotent_request.connect(record, weak=False)
    request_started.connect(started, weak=False)
    posts: list[str] = []
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
            try:
                page = browser.new_page(viewport={"width": 960, "height": 560})
                page.route("**/static/**", serve_static)
                page.on(
                    "request",
                    lambda r: posts.append(r.url) if r.method == "POST" else None,
                )
                page.goto(f"{live_server.url}/shop/")
                page.fill("#qty-tea-longjing", "2")
                page.fill("#qty-cup-celadon", "1")
                # The shop wears its own stylesheet (demo_project/static, no CDN).
                masthead = "getComputedStyle(document.querySelector('.masthead')).backgroundColor"
                assert page.evaluate(masthead) == "rgb(63, 107, 58)"
                page.evaluate("document.activeElement.blur()")  # no focus ring in the picture
                SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(SCREENSHOT), full_page=True)
                # A customer clicks "Place order", and clicks again while it loads.
                # (A dblclick within one task is folded into one submission by
                # Chromium itself; the second click must come once the first POST
                # is on the wire, as an impatient customer's does.)
                box = page.locator("#pay").bounding_box()
                assert box is not None
                x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
                with page.expect_request(lambda r: r.method == "POST"):
                    page.mouse.click(x, y)
                # The request event fires before the POST reaches the server, and a
                # second click before then cancels the first POST: the server would see
                # one submit. Click again once the server has the first one.
                assert arrived.wait(timeout=30)
                page.mouse.click(x, y)
                # The second click aborts the first navigation (the browser drops the
                # first response): wait for the page the second submit lands on.
                page.locator("#order").wait_for(timeout=30_000)
                landed = page.url
                heading = page.text_content("#order")
                # Under load the first response can land before the second submit is
                # answered: let the server finish with both before the browser closes.
                wait_until(lambda: len(outcomes) >= 2, timeout=30)
            finally:
                browser.close()
    finally:
        idempotent_request.disconnect(record)
        request_started.disconnect(started)

    order = Order.objects.get()  # exactly one
    assert landed == f"{live_server.url}/shop/orders/{order.pk}/"
    assert heading == f"Order {order.pk}"
    # Both submits reached the server with the same token: the first created the
    # order, the second was sent to the same order page instead of a second order.
    assert len(posts) == 2, posts
    assert len({key for key, _ in outcomes}) == 1
    assert sorted(outcome for _, outcome in outcomes) == ["executed", "redirected"], outcomes
    assert str(order.amount) == "221.50"
    assert SCREENSHOT.stat().st_size > 10_000
