"""Django admin through its real URLs: changelists, filters, audited idempotent actions."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db.models import F
from django.test import Client
from django.urls import reverse

from demo_project import warehouse
from idempotent_orders import admin as io_admin
from idempotent_orders.admin import order_actions
from idempotent_orders.consuming.running import apply_transition
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.fulfilment import fulfil, fulfilment_message_id
from idempotent_orders.models import (
    AuditEntry,
    InboxStatus,
    Order,
    OrderStatus,
    ProcessedMessage,
)
from tests.support.admin import shown
from tests.support.messages import payment

pytestmark = pytest.mark.django_db
S = OrderStatus


@pytest.fixture
def customer() -> Client:
    user = get_user_model().objects.create_user("customer", "c@example.com", "pw")
    client = Client()
    client.force_login(user)
    return client


def changelist(model: str) -> str:
    return reverse(f"admin:idempotent_orders_{model}_changelist")


def act(client: Client, model: str, action: str, *pks: Any, **query: str) -> Any:
    """Run an action on rows ``pks``: its confirmation page first, then "Yes, I'm sure"."""
    url = changelist(model)
    if query:
        url += "?" + "&".join(f"{k}={v}" for k, v in query.items())
    data = {"action": action, "_selected_action": [str(pk) for pk in pks]}
    page = client.post(url, data)
    assert page.status_code == 200
    assert "are you sure?" in page.content.decode()
    return client.post(url, {**data, "post": "yes"}, follow=True)


def transition(client: Client, action: str, order: Order) -> Any:
    """Run a transition action on ``order`` and confirm it, as the version it has now."""
    data = {
        "action": action,
        "_selected_action": [str(order.pk)],
        "post": "yes",
        f"version-{order.pk}": str(Order.objects.get(pk=order.pk).version),
    }
    return client.post(changelist("order"), data, follow=True)


def stuck_fulfilment(order: Order, *modes: str) -> ProcessedMessage:
    consume_message(payment(order), consumer="payments")
    warehouse.script(order.pk, *modes)
    fulfil(order.pk)
    return ProcessedMessage.objects.get(message_id=fulfilment_message_id(order.pk))


def test_the_admin_package_registers_each_model_admin_and_keeps_its_names() -> None:
    from django.contrib import admin

    from idempotent_orders.models import IdempotencyKey, OutboxMessage, ParkedMessage

    # Named, not imported here: importing a module would register its admins itself.
    expected = {
        Order: "orders.OrderAdmin",
        ProcessedMessage: "inbox.ProcessedMessageAdmin",
        ParkedMessage: "evidence.ParkedMessageAdmin",
        AuditEntry: "evidence.AuditEntryAdmin",
        OutboxMessage: "outbox.OutboxMessageAdmin",
        IdempotencyKey: "keys.IdempotencyKeyAdmin",
    }
    registered = {}
    for model in expected:
        model_admin = (
            type(admin.site.get_model_admin(model)) if admin.site.is_registered(model) else None
        )
        registered[model] = model_admin and f"{model_admin.__module__}.{model_admin.__qualname__}"
    assert registered == {m: f"idempotent_orders.admin.{name}" for m, name in expected.items()}
    # What projects and the docs import from idempotent_orders.admin is still there.
    documented = {"OrderAdminMixin", "OrderAdmin", "OrderChangeForm", "attention", "audit"}
    assert documented <= set(io_admin.__all__)
    assert [name for name in io_admin.__all__ if not hasattr(io_admin, name)] == []


@pytest.mark.parametrize("model", ["order", "processedmessage", "parkedmessage", "auditentry"])
def test_changelists_open_for_staff_and_refuse_others(staff, customer, model) -> None:
    assert staff.get(changelist(model)).status_code == 200
    response = customer.get(changelist(model))
    assert response.status_code == 302
    assert reverse("admin:login") in response["Location"]
    assert Client().get(changelist(model)).status_code == 302


def test_order_transition_action_goes_through_the_conditional_update(staff, make_order) -> None:
    order = make_order()
    response = transition(staff, "transition_cancel", order)
    assert response.status_code == 200
    assert shown(response) == [f"Order {order.pk}: pending payment -> cancelled"]
    assert Order.objects.get(pk=order.pk).status == S.CANCELLED
    # Idempotent: a second click finds the order at the target.
    response = transition(staff, "transition_cancel", order)
    assert shown(response) == [f"Order {order.pk}: already cancelled; nothing to do"]
    assert Order.objects.get(pk=order.pk).version == 1
    entries = list(AuditEntry.objects.order_by("id").values_list("username", "action", "result"))
    assert entries == [
        ("operator", "transition:cancel", "applied"),
        ("operator", "transition:cancel", "at_target"),
    ]


def test_transition_not_allowed_is_a_message(staff, make_order) -> None:
    order = make_order()
    response = transition(staff, "transition_ship", order)
    assert response.status_code == 200
    assert shown(response) == [f"Order {order.pk}: cannot ship from pending payment"]
    assert Order.objects.get(pk=order.pk).status == S.PENDING_PAYMENT


def test_conflict_is_a_message_not_an_error(staff, make_order, monkeypatch) -> None:
    order = make_order()

    def racing(instance: Order, name: str, **kwargs: Any):
        # Another writer commits between the admin's read and its UPDATE.
        Order.objects.filter(pk=instance.pk).update(version=F("version") + 1)
        return apply_transition(instance, name, **kwargs)

    # The transition actions look apply_transition up in their own module.
    monkeypatch.setattr(order_actions, "apply_transition", racing)
    response = transition(staff, "transition_cancel", order)
    assert response.status_code == 200
    assert any("changed while you looked" in m for m in shown(response))
    assert Order.objects.get(pk=order.pk).status == S.PENDING_PAYMENT
    assert AuditEntry.objects.get().result == "conflict"


def test_non_staff_cannot_run_actions(customer, make_order) -> None:
    order = make_order()
    response = customer.post(
        changelist("order"), {"action": "transition_cancel", "_selected_action": [order.pk]}
    )
    assert response.status_code == 302
    assert Order.objects.get(pk=order.pk).status == S.PENDING_PAYMENT
    assert not AuditEntry.objects.exists()


def test_staff_without_change_permission_is_refused(make_order) -> None:
    user = get_user_model().objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_order"))
    client = Client()
    client.force_login(user)
    assert client.get(changelist("order")).status_code == 200
    order = make_order()
    response = client.post(
        changelist("order"), {"action": "transition_cancel", "_selected_action": [order.pk]}
    )
    assert Order.objects.get(pk=order.pk).status == S.PENDING_PAYMENT
    assert response.status_code in {200, 302, 403}
    assert not AuditEntry.objects.exists()


def test_attention_filters(staff, make_order) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from idempotent_orders import leases

    refused = stuck_fulfilment(make_order(), "fail")
    failed = stuck_fulfilment(make_order(), "fail")
    # A worker that died mid-call: its lease runs out with no word.
    quiet = make_order()
    leases.claim(consumer="fulfilment", message_id="fulfil-quiet", token=0, order=quiet)
    ProcessedMessage.objects.filter(message_id="fulfil-quiet").update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    ProcessedMessage.objects.filter(pk=failed.pk).update(status=InboxStatus.FAILED)
    consume_message({"message_id": "bad-1", "type": "nope"}, consumer="payments")

    def listed(value: str) -> set[str]:
        response = staff.get(changelist("processedmessage") + f"?attention={value}")
        assert response.status_code == 200
        return {r.message_id for r in response.context["cl"].result_list}

    assert listed("stuck") == {"fulfil-quiet"}
    assert listed("refused") == {refused.message_id}
    assert listed("failed") == {failed.message_id}
    assert listed("rejected") == {"bad-1"}
    response = staff.get(changelist("processedmessage") + "?attention=rejected")
    assert "unknown message type" in response.content.decode()


def test_retry_action_verifies_then_completes_once(staff, make_order) -> None:
    order = make_order()
    row = stuck_fulfilment(order, "lose_reply")
    response = act(staff, "processedmessage", "retry", row.pk)
    assert shown(response) == [
        f"Retry (verifies first) fulfilment:{row.message_id} (order {order.pk}): "
        "completed; now applied."
    ]
    assert Order.objects.get(pk=order.pk).status == S.PROCESSING
    assert warehouse.effects(order.pk) == 1
    response = act(staff, "processedmessage", "retry", row.pk)
    assert "nothing done: applied: nothing to retry" in " ".join(shown(response))
    assert warehouse.effects(order.pk) == 1
    assert list(AuditEntry.objects.order_by("id").values_list("action", "result")) == [
        ("retry", "completed"),
        ("retry", "skipped"),
    ]


def test_complete_action_refuses_an_unverified_effect(staff, make_order) -> None:
    order = make_order()
    row = stuck_fulfilment(order, "fail")
    response = act(staff, "processedmessage", "complete_verified", row.pk)
    assert shown(response) == [
        f"Complete after verification fulfilment:{row.message_id} (order {order.pk}): "
        "not finished, it waits for the next attempt; now processing: "
        "an operator asked to complete it; the effect is not verified."
    ]
    assert Order.objects.get(pk=order.pk).status == S.PAID
    assert ProcessedMessage.objects.get(pk=row.pk).status == InboxStatus.PROCESSING

    verified = make_order()
    row = stuck_fulfilment(verified, "lose_reply")
    response = act(staff, "processedmessage", "complete_verified", row.pk)
    assert ": completed; now applied." in " ".join(shown(response))
    assert Order.objects.get(pk=verified.pk).status == S.PROCESSING
    assert warehouse.effects(verified.pk) == 1


def test_fail_action_is_idempotent_and_audited(staff, make_order) -> None:
    row = stuck_fulfilment(make_order(), "fail")
    act(staff, "processedmessage", "fail", row.pk)
    act(staff, "processedmessage", "fail", row.pk)
    assert ProcessedMessage.objects.get(pk=row.pk).status == InboxStatus.FAILED
    assert list(AuditEntry.objects.order_by("id").values_list("action", "result")) == [
        ("fail", "failed"),
        ("fail", "skipped"),
    ]
    entry = AuditEntry.objects.first()
    assert entry is not None
    assert entry.target == "idempotent_orders.processedmessage"
    assert entry.object_id == str(row.pk)


def test_parked_changelist_shows_waiting_time(staff, make_order) -> None:
    order = make_order()
    consume_message(payment(order, seq=2), consumer="payments")
    response = staff.get(changelist("parkedmessage"))
    assert response.status_code == 200
    assert "waiting" in response.content.decode().lower()
    assert "minute" in response.content.decode()
    # The order column links to the order's change page.
    link = reverse("admin:idempotent_orders_order_change", args=[order.pk])
    assert f'href="{link}"' in response.content.decode()


# -- transitions the admin cannot draw ----------------------------------------------------------


@pytest.mark.parametrize("undrawable", ["none", "return_value"])
def test_a_transition_without_a_target_state_is_not_offered(undrawable: str) -> None:
    """Registering the mixin on such a model does not raise; that transition gets no
    "Mark as" action, and the others keep theirs.
    """
    from django.contrib.admin import AdminSite, ModelAdmin
    from django.test.utils import isolate_apps
    from django_fsm import RETURN_VALUE, FSMField
    from django_fsm import transition as fsm_transition

    from idempotent_orders.models import AbstractOrder

    with isolate_apps("demo_project"):

        class Ticket(AbstractOrder):
            state = FSMField(default="open")

            class Meta:
                app_label = "demo_project"

            @fsm_transition(field=state, source="open", target="closed")
            def close(self) -> None: ...

            if undrawable == "none":

                @fsm_transition(field=state, source="*", target=None)
                def comment(self) -> None: ...

            else:

                @fsm_transition(field=state, source="open", target=RETURN_VALUE("closed"))
                def triage(self) -> str:
                    return "closed"

        class TicketAdmin(io_admin.OrderAdminMixin, ModelAdmin):
            pass

        site = AdminSite(name="tickets")
        site.register(Ticket, TicketAdmin)
        actions = [getattr(a, "__name__", a) for a in site.get_model_admin(Ticket).actions or ()]
    assert actions == ["transition_close"]


# -- lists at size --------------------------------------------------------------------


LISTS = ["processedmessage", "parkedmessage", "outboxmessage", "auditentry"]


@pytest.mark.parametrize("model", LISTS)
def test_a_big_list_runs_no_distinct_and_no_second_count(staff, make_order, model) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    order = make_order()
    consume_message(payment(order), consumer="payments")
    consume_message(payment(order, seq=5), consumer="payments")  # parked
    with CaptureQueriesContext(connection) as queries:
        response = staff.get(changelist(model))
    assert response.status_code == 200
    sql = [q["sql"].upper() for q in queries]
    assert not [s for s in sql if "DISTINCT" in s]
    # The page's own count only, never the unfiltered total beside it.
    table = f"IDEMPOTENT_ORDERS_{model.upper()}"
    counts = [s for s in sql if "COUNT(" in s and table in s]
    assert len(counts) <= 1
    # ... and that count stops reading at the paginator's cap (a LIMIT inside it).
    assert all(" LIMIT " in s for s in counts), counts
    assert response.context["cl"].model_admin.show_full_result_count is False


def test_the_order_list_counts_capped_and_searches_the_business_key_exactly(
    staff, make_order
) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    order = make_order()
    make_order()
    url = reverse("admin:idempotent_orders_order_changelist")
    with CaptureQueriesContext(connection) as queries:
        response = staff.get(url, {"q": order.business_key})
    assert [o.pk for o in response.context["cl"].result_list] == [order.pk]
    sql = [q["sql"].upper() for q in queries if "IDEMPOTENT_ORDERS_ORDER" in q["sql"].upper()]
    assert not [s for s in sql if " LIKE " in s or "UPPER(" in s], sql
    counts = [s for s in sql if "COUNT(" in s]
    assert counts
    assert all(" LIMIT " in s for s in counts), counts
    # A part of the key finds nothing: the search is exact, on the unique index.
    response = staff.get(url, {"q": order.business_key[:-2]})
    assert list(response.context["cl"].result_list) == []


def test_the_order_list_filters_currency_without_a_distinct_over_every_order(
    staff, make_order
) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from idempotent_orders.admin.orders import CurrencyFilter

    old = make_order(currency="USD")
    for _ in range(CurrencyFilter.recent):
        make_order(currency="CNY")
    url = reverse("admin:idempotent_orders_order_changelist")
    with CaptureQueriesContext(connection) as queries:
        response = staff.get(url)
    sql = [q["sql"].upper() for q in queries if "IDEMPOTENT_ORDERS_ORDER" in q["sql"].upper()]
    assert not [s for s in sql if "DISTINCT" in s], sql
    specs = {spec.title: spec for spec in response.context["cl"].filter_specs}
    # The newest orders' currencies; an older one is still one parameter away.
    assert [v for v, _ in specs["currency"].lookup_choices] == ["CNY"]
    found = staff.get(url, {"currency": "USD"})
    assert [o.pk for o in found.context["cl"].result_list] == [old.pk]


def test_list_filters_offer_fixed_values(staff, make_order) -> None:
    order = make_order()
    consume_message(payment(order), consumer="payments")
    response = staff.get(changelist("processedmessage"))
    specs = {spec.title: spec for spec in response.context["cl"].filter_specs}
    assert "payment.succeeded" in [v for v, _ in specs["message type"].lookup_choices]
    found = staff.get(changelist("processedmessage"), {"message_type": "payment.succeeded"})
    assert [r.message_id for r in found.context["cl"].result_list]
    # Any consumer is still one parameter away.
    found = staff.get(changelist("processedmessage"), {"consumer": "payments"})
    assert found.context["cl"].result_list.count() == 1
    audit = staff.get(changelist("auditentry"))
    targets = [v for v, _ in audit.context["cl"].filter_specs[0].lookup_choices]
    assert "idempotent_orders.processedmessage" in targets


def test_searches_are_exact_on_keys(staff, make_order) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    order = make_order()
    msg = payment(order)
    consume_message(msg, consumer="payments")
    url = changelist("processedmessage")

    def found(q: str) -> list[str]:
        with CaptureQueriesContext(connection) as queries:
            response = staff.get(url, {"q": q})
        sql = " ".join(q["sql"].upper() for q in queries)
        assert " LIKE " not in sql
        assert "ILIKE" not in sql
        assert "UPPER(" not in sql
        return [r.message_id for r in response.context["cl"].result_list]

    assert found(msg["message_id"]) == [msg["message_id"]]
    assert found(msg["message_id"][:-1]) == []  # no substring match
    assert msg["message_id"] in found(str(order.pk))  # the order's rows
    assert found("not-a-number") == []
