"""A message changes the order exactly as ``order.pay(...); order.save()`` would.

The differential suite: the same business events applied by the project's own code
(transition, then ``save()``) on one order and delivered as messages (3 copies each,
shuffled, through ``consume_message`` and ``consume_batch``) on another, compared by
what the project sees: django-simple-history's rows, django-auditlog's entries, the
``save()`` override's derived field and search-index row, the ``post_save`` receiver's
calls. Runs on every database of the matrix (``tests.settings_history``).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from typing import Any
from unittest import mock

import pytest
import reversion
from auditlog.models import LogEntry
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from reversion.models import Version

from idempotent_orders.consuming import current_message, registry, writing
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.failures import MessageFailed
from idempotent_orders.consuming.graph import TransitionStatus
from idempotent_orders.consuming.running import apply_transition, road, save_hooks
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import Outcome, ProcessedMessage
from tests.history.models import Order, OrderEvent, SavedCall, SearchEntry

pytestmark = pytest.mark.django_db(transaction=True)

PAYMENT = {"payment_id": "pi_1", "amount": "30.00", "currency": "EUR"}
SHIPMENT = {"tracking_number": "TRK-1", "carrier": "DHL"}
DELIVERY = {"tracking_number": "TRK-1"}


def new_order() -> Order:
    return Order.objects.create(
        business_key=f"order-{uuid.uuid4().hex}", amount=Decimal("30.00"), currency="EUR"
    )


def plain(order: Order) -> None:
    """The project's own code, without the app: what each event does, then save(),
    each in a revision of its own (as a view under ``RevisionMiddleware``)."""
    with reversion.create_revision():
        order.pay(payment_id=PAYMENT["payment_id"])
        order.save()
    with reversion.create_revision():
        # What the shipment validator writes, set as the shop's own code would.
        order.tracking_number, order.carrier = SHIPMENT["tracking_number"], SHIPMENT["carrier"]
        order.ship()
        order.save()
    with reversion.create_revision():
        order.complete()
        order.save()


def messages(order: Order, *, seq: bool) -> list[dict[str, Any]]:
    events = [
        ("payment.succeeded", PAYMENT),
        ("shipment.dispatched", SHIPMENT),
        ("shipment.delivered", DELIVERY),
    ]
    found = []
    for n, (kind, payload) in enumerate(events, start=1):
        message = {
            "message_id": f"{order.pk}-{kind}",
            "type": kind,
            "order_id": order.pk,
            "payload": dict(payload),
        }
        if seq:
            message["seq"] = n
        found.append(message)
    return found


@contextmanager
def merged_road() -> Iterator[list[Outcome]]:
    """The outcomes the two texts applied (declined messages left out)."""
    taken: list[Outcome] = []
    real = writing._in_two_texts

    def spy(*args: Any, **kwargs: Any) -> Any:
        done = real(*args, **kwargs)
        if done is not None:
            taken.append(done[0])
        return done

    with mock.patch.object(writing, "_in_two_texts", spy):
        yield taken


def trail(order: Order) -> dict[str, Any]:
    """What the project's code and packages kept of one order, without ids and times."""
    order.refresh_from_db()
    content_type = ContentType.objects.get_for_model(Order)
    return {
        "fields": (
            order.status,
            order.total,
            order.shipping_fee,
            order.payment_id,
            order.tracking_number,
            order.carrier,
        ),
        "simple_history": [
            (h.history_type, h.status, h.total, h.payment_id, h.tracking_number)
            for h in order.history.order_by("history_date", "history_id")
        ],
        "auditlog": [
            (entry.action, sorted(entry.changes_dict))
            for entry in LogEntry.objects.filter(
                content_type=content_type, object_pk=str(order.pk)
            ).order_by("timestamp", "id")
        ],
        "post_save": [
            (c.status, c.total, c.created)
            for c in SavedCall.objects.filter(order_id=order.pk).order_by("id")
        ],
        "search": list(
            SearchEntry.objects.filter(order_id=order.pk).values_list("text", flat=True)
        ),
        "reversion": [
            (v.field_dict["status"], v.field_dict["total"])
            for v in Version.objects.get_for_object(order).order_by("pk")
        ],
        # django-pghistory's triggers (PostgreSQL only; elsewhere nothing is recorded).
        "pghistory": [
            (e.pgh_label, e.status, e.total, e.payment_id, e.tracking_number)
            for e in OrderEvent.objects.filter(pgh_obj_id=order.pk).order_by("pgh_id")
        ],
    }


def test_the_model_takes_the_save_road_and_says_why() -> None:
    hooks = save_hooks(Order)
    assert any(h.startswith("save() override in tests.history.models.Order") for h in hooks)
    assert any("simple_history" in h for h in hooks)
    assert any("auditlog" in h for h in hooks)
    assert any("tests.history.models.record_save" in h for h in hooks)
    name, why = road(Order, "pay")
    assert name == "save"
    assert "simple_history" in why


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("way", ["single", "single-in-atomic", "batch"])
@pytest.mark.parametrize("seq", [True, False])
def test_messages_leave_the_trail_of_plain_calls(seed: int, way: str, seq: bool) -> None:
    expected_order = new_order()
    plain(Order.objects.get(pk=expected_order.pk))  # as read, as a shop's view reads it
    expected = trail(expected_order)
    # The plain road's trail is what a shop sees: one row per save, the derived total.
    steps = ["new", "paid", "shipped", "completed"]
    assert [row[1] for row in expected["simple_history"]] == steps
    assert [row[0] for row in expected["reversion"]] == steps[1:]
    if connection.vendor == "postgresql":
        assert [row[1] for row in expected["pghistory"]] == steps
    assert expected["fields"][1] == Decimal("34.90")

    order = new_order()
    deliveries = [m for m in messages(order, seq=seq) for _ in range(3)]
    if seq:
        random.Random(seed).shuffle(deliveries)
    else:
        # Without seq the messages must come in a causal order; copies are shuffled in.
        rng = random.Random(seed)
        deliveries = sorted(deliveries, key=lambda m: m["type"] != "payment.succeeded")
        head, tail = deliveries[:3], deliveries[3:]
        rng.shuffle(tail)
        deliveries = head + sorted(tail, key=lambda m: m["type"] == "shipment.delivered")
    outcomes = []
    if way.startswith("single"):
        # A revision block of its own around each message: in the caller's transaction
        # (reversion's default), or not. Either way, on PostgreSQL and MariaDB, the read
        # goes in the claim's round trip (writing._in_two_texts; in the caller's
        # transaction the two texts open and release a savepoint).
        atomic = way == "single-in-atomic"
        with merged_road() as merged:
            for m in deliveries:
                with reversion.create_revision(atomic=atomic):
                    outcomes.append(consume_message(m, consumer="payments"))
        if connection.vendor in ("postgresql", "mysql"):
            # Each message that did not wait for another (those are released by the
            # usual road after their predecessor), the payment at least.
            assert merged
            assert set(merged) == {Outcome.APPLIED}
            if not seq:
                assert len(merged) == 3
        else:
            assert merged == []
    else:
        for start in range(0, len(deliveries), 4):
            outcomes += consume_batch(deliveries[start : start + 4], consumer="payments")
    assert Outcome.FAILED not in outcomes
    got = trail(order)
    if way == "batch" or seq:
        # reversion keeps one version per object per revision block: a batch, or a
        # message that releases its parked successors, applies several transitions in
        # one. Compared where each consume applies at most one (single, no seq).
        revisions, wanted = got.pop("reversion"), expected.pop("reversion")
        if way == "batch":
            assert revisions == []  # no revision block around a batch here
        else:
            assert revisions[-1] == wanted[-1]
    assert got == expected
    assert ProcessedMessage.objects.filter(order_id=order.pk, outcome=Outcome.APPLIED).count() == 3


def test_a_receiver_sees_the_message_being_consumed() -> None:
    order = new_order()
    consume_message(messages(order, seq=False)[0], consumer="payments")
    consume_message(messages(order, seq=False)[1], consumer="payments")
    calls = list(SavedCall.objects.filter(order_id=order.pk).order_by("id"))
    assert [(c.message_id, c.tracking_number) for c in calls] == [
        ("", ""),  # the create, outside a consume
        (f"{order.pk}-payment.succeeded", ""),
        (f"{order.pk}-shipment.dispatched", "TRK-1"),
    ]
    assert current_message() is None


def test_a_lost_race_leaves_no_trail() -> None:
    order = new_order()
    stale = Order.objects.get(pk=order.pk)
    consume_message(messages(order, seq=False)[0], consumer="payments")
    before = trail(order)
    # A writer that read the order before the payment committed: the guarded save()
    # matches no row, nothing after its UPDATE runs, and the order is left alone.
    result = apply_transition(stale, "cancel")
    assert result.status is TransitionStatus.CONFLICT
    assert stale.status == "new"
    assert trail(order) == before


def test_a_raising_body_leaves_no_trail() -> None:
    registry.register("warehouse.held", transition="hold")
    order = new_order()
    consume_message(messages(order, seq=False)[0], consumer="payments")
    before = trail(order)
    held = {
        "message_id": f"{order.pk}-held",
        "type": "warehouse.held",
        "order_id": order.pk,
        "payload": {"reason": "boom"},
    }
    with pytest.raises(MessageFailed):
        consume_message(held, consumer="payments")
    assert trail(order) == before
    assert ProcessedMessage.objects.get(message_id=held["message_id"]).status == "failed"


def test_parking_writes_nothing_on_the_order() -> None:
    order = new_order()
    early = messages(order, seq=True)[2]
    assert consume_message(early, consumer="payments") is Outcome.PARKED
    order.refresh_from_db()
    assert not order.has_parked
    assert order.history.count() == 1  # the create only
    assert LogEntry.objects.filter(object_pk=str(order.pk)).count() == 1
    for message in messages(order, seq=True)[:2]:
        consume_message(message, consumer="payments")
    order.refresh_from_db()
    assert order.status == "completed"  # released without the flag


def test_a_payment_that_may_still_apply_in_a_cycle_is_parked_not_misfiled() -> None:
    """on_hold -> reset -> new: an order on hold may come round to ``pay`` again, so a
    payment arriving then is not "moved past this step" (stale) nor money to give back."""
    from idempotent_orders.consuming.graph import classify

    assert classify(Order, "pay", "on_hold") is TransitionStatus.LATER
    assert classify(Order, "pay", "completed") is TransitionStatus.PAST_TARGET
    order = new_order()
    consume_message(messages(order, seq=False)[0], consumer="payments")
    assert apply_transition(Order.objects.get(pk=order.pk), "hold").applied
    again = {**messages(order, seq=False)[0], "message_id": f"{order.pk}-pay-again"}
    assert consume_message(again, consumer="payments") is Outcome.PARKED
    # Back at the start, the parked payment goes ahead: its payment was spent by this
    # very order, so it is a duplicate, never a second charge.
    reset = Order.objects.get(pk=order.pk)
    assert apply_transition(reset, "reset").applied
    from idempotent_orders.consuming.single import release_parked

    assert release_parked(order.pk) == [Outcome.DUPLICATE]
    order.refresh_from_db()
    assert order.status == "new"
