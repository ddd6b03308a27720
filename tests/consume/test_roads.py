"""The road a message takes is detected from the model and its receivers, never set.

The default ``Order`` has nothing of the project's to run: the app's own statement
commits a message. Connect a ``post_save`` receiver and the same message goes through
the model's ``save()``: the receiver runs once per applied transition, as it does for
``order.pay(); order.save()``, and never for a duplicate.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from django.core.management import call_command
from django.db.models import F, QuerySet
from django.db.models.signals import post_save, pre_save

from idempotent_orders import get_order_model
from idempotent_orders.consuming import current_message, registry
from idempotent_orders.consuming.graph import TransitionStatus
from idempotent_orders.consuming.running import (
    apply_transition,
    keeps_parked_flag,
    road,
    save_hooks,
)
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import Outcome

pytestmark = pytest.mark.django_db(transaction=True)


def payment(order: Any, message_id: str = "pay-1") -> dict[str, Any]:
    return {
        "message_id": f"{message_id}-{order.pk}",
        "type": "payment.succeeded",
        "order_id": order.pk,
        "payload": {"payment_id": f"pi-{order.pk}", "amount": "12.50", "currency": "CNY"},
    }


@pytest.fixture
def receiver() -> Iterator[list[tuple[str, str | None]]]:
    """A project's ``post_save`` receiver on the order model, for one test."""
    calls: list[tuple[str, str | None]] = []

    def saved(sender: Any, instance: Any, **kwargs: Any) -> None:
        message = current_message()
        calls.append((instance.status, message.message_id if message else None))

    model = get_order_model()
    post_save.connect(saved, sender=model, weak=False, dispatch_uid="tests.consume.test_roads")
    try:
        yield calls
    finally:
        post_save.disconnect(sender=model, dispatch_uid="tests.consume.test_roads")


def test_nothing_of_the_project_takes_the_raw_road() -> None:
    model = get_order_model()
    assert save_hooks(model) == ()
    assert road(model, "pay")[0] == "raw"
    assert keeps_parked_flag(model)


def test_a_post_save_receiver_takes_the_save_road(make_order: Any, receiver: list[Any]) -> None:
    model = get_order_model()
    name, why = road(model, "pay")
    assert name == "save"
    assert "post_save receiver tests.consume.test_roads" in why
    assert keeps_parked_flag(model)  # receivers never see the flag's queryset UPDATE
    order = make_order()
    receiver.clear()  # the create
    message = payment(order)
    assert consume_message(message, consumer="payments") is Outcome.APPLIED
    assert consume_message(message, consumer="payments") is Outcome.DUPLICATE
    # A copy under a new id: the spent payment says duplicate, nothing is saved.
    assert consume_message(payment(order, "pay-2"), consumer="payments") is Outcome.DUPLICATE
    assert receiver == [("paid", message["message_id"])]
    order.refresh_from_db()
    assert (order.status, order.version) == ("paid", 1)


def test_the_guarded_save_sends_its_update_without_building_a_query(
    make_order: Any, receiver: list[Any]
) -> None:
    """The guarded ``save()``'s UPDATE is sent from SQL kept per shape of row, not from a
    queryset built and compiled per message; a value that is an expression goes through
    Django's query, which spells it. Either way a stale instance's save() matches nothing."""
    model = get_order_model()
    built: list[Any] = []
    update = QuerySet._update

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        built.append(self.model)
        return update(self, *args, **kwargs)

    def as_expression(sender: Any, instance: Any, **kwargs: Any) -> None:
        instance.carrier = F("carrier")

    plain, expressed, raced = make_order(), make_order(), make_order()
    stale = model._default_manager.get(pk=raced.pk)
    with mock.patch.object(QuerySet, "_update", counted):
        assert consume_message(payment(plain), consumer="payments") is Outcome.APPLIED
        assert built == []
        pre_save.connect(as_expression, sender=model, dispatch_uid="tests.roads.expression")
        try:
            assert consume_message(payment(expressed), consumer="payments") is Outcome.APPLIED
        finally:
            pre_save.disconnect(sender=model, dispatch_uid="tests.roads.expression")
        assert built == [model]
        assert consume_message(payment(raced), consumer="payments") is Outcome.APPLIED
        # A writer that read the order before the payment: its guarded save() loses.
        assert apply_transition(stale, "cancel").status is TransitionStatus.CONFLICT
    for order in (plain, expressed, raced):
        order.refresh_from_db()
        assert (order.status, order.version) == ("paid", 1)


def test_the_road_follows_the_receivers(make_order: Any) -> None:
    model = get_order_model()
    calls: list[str] = []

    def saved(sender: Any, instance: Any, **kwargs: Any) -> None:
        calls.append(instance.status)

    post_save.connect(
        saved, sender=model, weak=False, dispatch_uid="tests.consume.test_roads.follow"
    )
    assert road(model, "pay")[0] == "save"
    post_save.disconnect(sender=model, dispatch_uid="tests.consume.test_roads.follow")
    assert road(model, "pay")[0] == "raw"
    order = make_order()
    calls.clear()
    assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    assert calls == []


def test_explain_names_each_type_and_its_road(receiver: list[Any]) -> None:
    import io

    out = io.StringIO()
    call_command("idempotent_orders_explain", stdout=out)
    text = out.getvalue()
    assert "payment.succeeded -> pay: save road" in text
    assert "post_save receiver tests.consume.test_roads" in text


def test_registering_a_money_type_again_keeps_it_money() -> None:
    before = registry.get_handler("payment.succeeded")
    assert before is not None
    assert before.money
    try:
        registry.register("payment.succeeded", transition="pay", validate=before.validate)
        again = registry.get_handler("payment.succeeded")
        assert again is not None
        assert again.money
        assert again.payment_key == "payment_id"
        registry.register(
            "payment.succeeded", transition="pay", validate=before.validate, payment_key="charge"
        )
        keyed = registry.get_handler("payment.succeeded")
        assert keyed is not None
        assert keyed.money
        assert keyed.payment_key == "charge"
        registry.register("payment.succeeded", transition="pay", money=False)
        plain = registry.get_handler("payment.succeeded")
        assert plain is not None
        assert not plain.money
    finally:
        registry._registry["payment.succeeded"] = before


def test_the_payment_key_names_the_spent_payment(make_order: Any) -> None:
    before = registry.get_handler("payment.succeeded")
    assert before is not None
    registry.register("provider.charge", transition="pay", money=True, payment_key="charge_id")
    try:
        first, second = make_order(), make_order()
        charge = {
            "message_id": f"charge-{first.pk}",
            "type": "provider.charge",
            "order_id": first.pk,
            "payload": {"charge_id": "ch_1"},
        }
        assert consume_message(charge, consumer="payments") is Outcome.APPLIED
        # The same charge for another order: money to give back, never a second payment.
        other = {**charge, "message_id": f"charge-{second.pk}", "order_id": second.pk}
        assert consume_message(other, consumer="payments") is Outcome.REJECTED
        second.refresh_from_db()
        assert second.status == "pending_payment"
    finally:
        registry._registry.pop("provider.charge", None)


def test_a_save_that_writes_nothing_fails_the_message_never_applied(
    make_order: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A project's save() that returns without super().save(): the message is kept as
    failed with why, never recorded as applied over an unchanged order."""
    from idempotent_orders.consuming.failures import MessageFailed
    from idempotent_orders.models import ProcessedMessage

    model = get_order_model()
    order = make_order()

    def save(self: Any, *args: Any, **kwargs: Any) -> None:
        """Skips the write (a bug a shop can have)."""

    monkeypatch.setattr(model, "save", save)
    assert road(model, "pay")[0] == "save"
    message = payment(order)
    with pytest.raises(MessageFailed):
        consume_message(message, consumer="payments")
    row = ProcessedMessage.objects.get(consumer="payments", message_id=message["message_id"])
    assert row.status == "failed"
    assert "returned without writing" in row.error
    order.refresh_from_db()
    assert (order.status, order.version) == ("pending_payment", 0)


@pytest.mark.backends("postgresql")
def test_the_statements_each_road_sends(make_order: Any) -> None:
    """PostgreSQL: the raw road is one statement (the inbox row and the guarded UPDATE
    together, no read); the save() road sends BEGIN, the claim and the read in one text,
    then save()'s UPDATE of every column, then COMMIT."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    model = get_order_model()
    table = model._meta.db_table
    first, raw_order, saved_order = make_order(), make_order(), make_order()
    consume_message(payment(first), consumer="payments")  # the session's first statements
    with CaptureQueriesContext(connection) as raw:
        assert consume_message(payment(raw_order), consumer="payments") is Outcome.APPLIED
    texts = [q["sql"] for q in raw.captured_queries]
    assert len(texts) == 1, texts
    assert f'UPDATE "{table}"' in texts[0]
    assert "INSERT INTO" in texts[0]

    def saved(sender: Any, **kwargs: Any) -> None:
        pass

    post_save.connect(
        saved, sender=model, weak=False, dispatch_uid="tests.consume.test_roads.count"
    )
    try:
        with CaptureQueriesContext(connection) as save_road:
            assert consume_message(payment(saved_order), consumer="payments") is Outcome.APPLIED
    finally:
        post_save.disconnect(sender=model, dispatch_uid="tests.consume.test_roads.count")
    # Django logs the BEGIN of its atomic block; the text itself carries it.
    texts = [q["sql"] for q in save_road.captured_queries if q["sql"] != "BEGIN"]
    assert texts[0].startswith("BEGIN; "), texts
    assert "INSERT INTO" in texts[0]
    assert f'FROM "{table}"' in texts[0]
    updates = [t for t in texts if t.startswith(f'UPDATE "{table}"')]
    assert len(updates) == 1, texts
    assert '"business_key" = ' in updates[0]  # save() writes every column
    assert texts[-1] == "COMMIT"
