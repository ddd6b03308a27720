"""The attention dashboard on the app index: counts, links, and a look in headless Chromium."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from idempotent_orders.models import (
    InboxStatus,
    Order,
    OutboxMessage,
    OutboxStatus,
    ParkedMessage,
    ProcessedMessage,
)
from tests.support.browser import (
    CHROMIUM,
    LAUNCH_ARGS,
    SCREENSHOTS,
    require_chromium,
    serve_static,
)

APP_INDEX = "/admin/idempotent_orders/"
SCREENSHOT = SCREENSHOTS / "admin-attention.png"


def prepare() -> dict[str, set[str]]:
    """Rows of every kind the dashboard counts, with look-alikes it must not count.

    Returns the ids (message ids) each line's filtered changelist must show.
    """
    now = timezone.now()
    hour = timedelta(hours=1)
    order = Order.objects.create(business_key="dash-1", amount="12.50", currency="CNY")

    def inbox(message_id: str, status: str, **fields: Any) -> None:
        ProcessedMessage.objects.create(
            consumer="fulfilment", message_id=message_id, status=status, order=order, **fields
        )

    inbox("stuck-1", InboxStatus.PROCESSING, lease_expires_at=now - hour)
    inbox("stuck-2", InboxStatus.PROCESSING, lease_expires_at=now - 2 * hour)
    inbox("busy-1", InboxStatus.PROCESSING, lease_expires_at=now + hour)  # a live lease
    inbox("failed-1", InboxStatus.FAILED)
    inbox("rejected-1", InboxStatus.REJECTED, error="unknown message type 'nope'")
    inbox("rejected-2", InboxStatus.REJECTED, error="amount does not match")
    start_of_today = timezone.localtime(now).replace(hour=0, minute=0, second=0, microsecond=0)
    inbox("rejected-old", InboxStatus.REJECTED, created_at=start_of_today - hour)
    inbox("done-1", InboxStatus.DONE)

    def parked(message_id: str, seq: int, **fields: Any) -> None:
        ParkedMessage.objects.create(
            consumer="payments",
            message_id=message_id,
            order=order,
            seq=seq,
            envelope={},
            reason="waiting for seq 1",
            **fields,
        )

    parked("parked-marked", 2, parked_at=now - 3 * hour, overdue_at=now - hour)
    parked("parked-old", 3, parked_at=now - 2 * hour)  # past PARKED_TIMEOUT, not marked yet
    parked("parked-fresh", 4, parked_at=now)

    def outbox(message_id: str, status: str, age: timedelta) -> None:
        OutboxMessage.objects.create(
            message_id=message_id,
            task_name="demo.award_points",
            payload={},
            status=status,
            created_at=now - age,
        )

    outbox("out-1", OutboxStatus.PENDING, 2 * hour + timedelta(minutes=5))
    outbox("out-2", OutboxStatus.PENDING, timedelta(minutes=1))
    outbox("out-sent", OutboxStatus.SENT, 3 * hour)
    return {
        "stuck": {"stuck-1", "stuck-2"},
        "failed": {"failed-1"},
        "rejected_today": {"rejected-1", "rejected-2"},
        "overdue": {"parked-marked", "parked-old"},
        "outbox_pending": {"out-1", "out-2"},
    }


@pytest.mark.django_db
def test_dashboard_counts_and_links_match_the_rows(settings: Any, staff: Client) -> None:
    settings.IDEMPOTENT_ORDERS = {**settings.IDEMPOTENT_ORDERS, "PARKED_TIMEOUT": 3600}
    expected = prepare()
    client = staff
    page = client.get(APP_INDEX)
    assert page.status_code == 200
    html = page.content.decode()
    for key, ids in expected.items():
        row = re.search(rf'<tr id="attention-{key}".*?</tr>', html, re.S)
        assert row is not None, key
        count = re.search(r'<td class="count"><a href="([^"]+)">(\d+)</a>', row.group(0))
        assert count is not None, key
        assert int(count.group(2)) == len(ids), key
        listed = client.get(count.group(1).replace("&amp;", "&"))
        assert {r.message_id for r in listed.context["cl"].result_list} == ids, key
    assert "oldest waiting 2\xa0hours" in html


@pytest.mark.django_db
def test_dashboard_shows_only_what_the_user_may_view() -> None:
    from django.contrib.auth.models import Permission

    prepare()
    user = get_user_model().objects.create_user("clerk", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_outboxmessage"))
    client = Client()
    client.force_login(user)
    html = client.get(APP_INDEX).content.decode()
    assert 'id="attention-outbox_pending"' in html
    assert 'id="attention-stuck"' not in html


@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.services
@pytest.mark.browser
def test_dashboard_in_headless_chromium(live_server: Any, settings: Any) -> None:
    sync_api = require_chromium()
    settings.IDEMPOTENT_ORDERS = {**settings.IDEMPOTENT_ORDERS, "PARKED_TIMEOUT": 3600}
    expected = prepare()
    get_user_model().objects.create_superuser("operator", "op@example.com", "operator-pw")
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.route("**/static/**", serve_static)
            page.goto(f"{live_server.url}/admin/login/?next={APP_INDEX}")
            page.fill("#id_username", "operator")
            page.fill("#id_password", "operator-pw")
            with page.expect_navigation():
                page.click("input[type=submit]")
            assert page.url == f"{live_server.url}{APP_INDEX}"
            shown = {
                key: int(page.text_content(f"#attention-{key} td.count") or "-1")
                for key in expected
            }
            assert shown == {key: len(ids) for key, ids in expected.items()}
            assert page.is_visible("#attention")
            page.screenshot(path=str(SCREENSHOT), full_page=True)

            with page.expect_navigation():
                page.click("#attention-stuck th a")
            assert "attention=stuck" in page.url
            listed = set(page.locator("#result_list tbody th a").all_text_contents())
            assert listed == expected["stuck"]
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000
