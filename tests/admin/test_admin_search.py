"""What an operator types finds what they mean: an order number finds that order, the
inbox's consumer filter offers every consumer the code writes rows for, and an audited
action appears in Django's own "Recent actions"."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.test import Client
from django.urls import reverse

from demo_project import warehouse
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.fulfilment import fulfil, fulfilment_message_id
from idempotent_orders.models import ProcessedMessage
from tests.support.messages import payment

pytestmark = pytest.mark.django_db


def test_an_order_number_finds_that_order_not_every_key_with_the_digit(
    staff: Client, make_order: Any
) -> None:
    orders = [make_order(business_key=f"key-{n}1{n}") for n in range(3)]
    wanted = orders[1]
    url = reverse("admin:idempotent_orders_order_changelist")
    for typed in (str(wanted.pk), f"#{wanted.pk}"):
        found = list(staff.get(url, {"q": typed}).context["cl"].result_list)
        assert [o.pk for o in found] == [wanted.pk], typed
    # A business key is still found by itself, exactly.
    found = list(staff.get(url, {"q": "key-010"}).context["cl"].result_list)
    assert [o.pk for o in found] == [orders[0].pk]


def test_the_consumer_filter_offers_every_consumer_in_use(staff: Client) -> None:
    response = staff.get(reverse("admin:idempotent_orders_processedmessage_changelist"))
    spec = next(s for s in response.context["cl"].filter_specs if s.title == "consumer")
    offered = {value for value, _ in spec.lookup_choices}
    assert {"payments", "shipping", "fulfilment"} <= offered


def test_an_audited_retry_is_in_django_s_recent_actions(staff: Client, make_order: Any) -> None:
    order = make_order()
    consume_message(payment(order), consumer="payments")
    warehouse.script(order.pk, "fail")
    fulfil(order.pk)
    row = ProcessedMessage.objects.get(message_id=fulfilment_message_id(order.pk))
    confirm = reverse("admin:idempotent_orders_processedmessage_confirm", args=[row.pk, "retry"])
    staff.post(confirm, {"post": "yes"})
    entry = LogEntry.objects.get()
    assert entry.action_flag == CHANGE
    assert entry.object_id == str(row.pk)
    assert entry.get_change_message().startswith("retry: completed.")
    assert entry.user.get_username() == "operator"
    index = staff.get("/admin/").content.decode()
    assert "None available" not in index
    assert entry.object_repr == f"fulfilment:{row.message_id} (applied)"
    assert entry.object_repr in index
