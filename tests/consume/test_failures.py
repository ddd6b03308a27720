"""Nothing is lost to an exception: a bug in a receiver, a body or a validator keeps the
message as failed (with why and its envelope), a later delivery retries it, the last
retry makes it a dead letter, and a requeue after the fix applies it exactly once.
One bad message in a batch never takes the good ones with it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django_fsm.signals import post_transition

from idempotent_orders import dedup, get_order_model
from idempotent_orders.admin.inbox import _requeue_and_redeliver
from idempotent_orders.consuming import registry
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.failures import MessageFailed, dead_letter
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.exceptions import InvalidMessage
from idempotent_orders.models import InboxStatus, Outcome, ProcessedMessage
from tests.support.messages import payment

pytestmark = pytest.mark.django_db(transaction=True)


class Switch:
    """A receiver with a bug, until it is fixed."""

    def __init__(self) -> None:
        self.broken = True
        self.calls = 0

    def __call__(self, sender: Any, instance: Any, name: str, **kwargs: Any) -> None:
        self.calls += 1
        if self.broken:
            raise ZeroDivisionError("a bug in a receiver")


@pytest.fixture
def receiver() -> Iterator[Switch]:
    switch = Switch()
    post_transition.connect(switch, sender=get_order_model(), weak=False)
    yield switch
    post_transition.disconnect(switch, sender=get_order_model())


def inbox(message: dict[str, Any]) -> ProcessedMessage:
    return ProcessedMessage.objects.get(consumer="payments", message_id=message["message_id"])


def test_a_raising_receiver_keeps_the_message_then_a_retry_applies_it_once(
    make_order: Any, receiver: Switch
) -> None:
    order = make_order()
    message = payment(order)
    for attempt in (1, 2):
        with pytest.raises(MessageFailed) as raised:
            consume_message(message, consumer="payments")
        assert isinstance(raised.value.__cause__, ZeroDivisionError)
        row = inbox(message)
        assert (row.status, row.outcome, row.attempts) == (InboxStatus.FAILED, "", attempt)
        assert row.error.startswith("ZeroDivisionError('a bug in a receiver') at ")
        assert "test_failures.py" in row.error
        assert json.loads(row.body) == {k: message[k] for k in message if k != "type"} | {
            "type": message["type"]
        }
        fresh = get_order_model()._default_manager.get(pk=order.pk)
        assert (fresh.version, fresh.payment_id) == (0, "")  # nothing of it was written
        # The fast path never answers for a failed message.
        assert dedup.lookup("payments", message["message_id"]) not in dedup.KNOWN

    receiver.broken = False
    assert consume_message(message, consumer="payments") is Outcome.APPLIED
    row = inbox(message)
    assert (row.status, row.outcome, row.attempts) == (InboxStatus.DONE, Outcome.APPLIED, 3)
    fresh = get_order_model()._default_manager.get(pk=order.pk)
    assert fresh.version == 1
    assert consume_message(message, consumer="payments") is Outcome.DUPLICATE
    assert get_order_model()._default_manager.get(pk=order.pk).version == 1


def test_a_dead_letter_waits_for_a_requeue_which_applies_it_once(
    make_order: Any, receiver: Switch
) -> None:
    order = make_order()
    message = payment(order)
    with pytest.raises(MessageFailed):
        consume_message(message, consumer="payments")
    assert dead_letter("payments", message["message_id"])
    row = inbox(message)
    assert row.status == InboxStatus.DEAD
    assert row.dead_at is not None
    # Delivered again while dead: not run (the receiver is not called), not applied.
    calls = receiver.calls
    assert consume_message(message, consumer="payments") is Outcome.DUPLICATE
    assert receiver.calls == calls
    assert inbox(message).status == InboxStatus.DEAD

    receiver.broken = False
    assert _requeue_and_redeliver(ids=[row.pk]) == 1
    row = inbox(message)
    assert (row.status, row.outcome) == (InboxStatus.DONE, Outcome.APPLIED)
    assert get_order_model()._default_manager.get(pk=order.pk).version == 1
    assert _requeue_and_redeliver(ids=[row.pk]) == 0  # not dead any more: nothing runs
    assert get_order_model()._default_manager.get(pk=order.pk).version == 1


@pytest.fixture
def fragile_type() -> Iterator[str]:
    """A type whose validator has a bug for some payloads."""

    def validate(order: Any, payload: Any) -> dict[str, Any]:
        if payload.get("boom"):
            raise RuntimeError("a bug in a validator")
        if payload.get("refuse"):
            raise InvalidMessage("refused on purpose")
        return {}

    name = f"test.fragile.{uuid.uuid4().hex[:6]}"
    registry.register(name, transition="cancel", validate=validate)
    yield name
    registry._registry.pop(name, None)


def _message(order: Any, kind: str, **payload: Any) -> dict[str, Any]:
    return {
        "message_id": f"frag-{uuid.uuid4().hex}",
        "type": kind,
        "order_id": order.pk,
        "payload": payload,
    }


def test_one_poison_message_in_a_batch_never_takes_the_good_ones_with_it(
    make_order: Any, fragile_type: str
) -> None:
    orders = [make_order() for _ in range(5)]
    good = [_message(o, fragile_type) for o in orders[:4]]
    poison = _message(orders[4], fragile_type, boom=True)
    refused = _message(orders[0], fragile_type, refuse=True)
    batch = [good[0], good[1], poison, good[2], refused, good[3]]
    outcomes = consume_batch(batch, consumer="payments")
    assert outcomes == [
        Outcome.APPLIED,
        Outcome.APPLIED,
        Outcome.FAILED,
        Outcome.APPLIED,
        Outcome.REJECTED,
        Outcome.APPLIED,
    ]
    states = dict(
        get_order_model()
        ._default_manager.filter(pk__in=[o.pk for o in orders])
        .values_list("pk", "status")
    )
    assert [states[o.pk] for o in orders] == ["cancelled"] * 4 + ["pending_payment"]
    row = inbox(poison)
    assert row.status == InboxStatus.FAILED
    assert "RuntimeError('a bug in a validator')" in row.error
    assert json.loads(row.body)["payload"] == {"boom": True}
    # The batch delivered again: the good ones are duplicates, the poison is tried again.
    again = consume_batch(batch, consumer="payments")
    assert again[2] is Outcome.FAILED
    assert inbox(poison).attempts == 2
    assert [again[i] for i in (0, 1, 3, 5)] == [Outcome.DUPLICATE] * 4


@pytest.mark.workers
def test_a_raising_receiver_under_a_real_worker_retries_then_dead_letters(
    celery_workers: Any, make_order: Any, tmp_path: Any
) -> None:
    """RabbitMQ, ``acks_late``, a receiver with a bug in the worker: the payment is kept as
    failed, retried with backoff, then a dead letter; fixed and requeued, it applies once.
    """
    from idempotent_orders.tasks import publish
    from tests.support.services import wait_until

    switch = tmp_path / "switch"
    switch.write_text("broken")
    workers = celery_workers(
        "rabbitmq",
        processes=1,
        extra_env={"IO_POISON_SWITCH": str(switch), "IO_TEST_TASK_MAX_RETRIES": "2"},
    )
    order = make_order(business_key=f"poison-{uuid.uuid4().hex}")
    message = payment(order)

    def row() -> ProcessedMessage | None:
        return ProcessedMessage.objects.filter(
            consumer="payments", message_id=message["message_id"]
        ).first()

    publish(message, consumer="payments")
    assert wait_until(
        lambda: (found := row()) is not None and found.status == InboxStatus.DEAD, timeout=90
    ), workers.log_tail()
    dead = row()
    assert dead is not None
    assert dead.attempts == 3  # the first delivery and two retries
    assert "ZeroDivisionError('a bug in a receiver') at support/poison.py:" in dead.error
    assert json.loads(dead.body)["payload"] == message["payload"]
    assert get_order_model()._default_manager.get(pk=order.pk).version == 0

    def succeeded() -> int:
        return sum(log.read_text(errors="replace").count("succeeded") for log in workers.logs)

    # Delivered again while dead: not run. Then fixed and requeued: applied once.
    done = succeeded()
    publish(message, consumer="payments")
    assert wait_until(lambda: succeeded() > done, timeout=30), workers.log_tail()
    assert row().status == InboxStatus.DEAD  # type: ignore[union-attr]
    switch.write_text("fixed")
    assert _requeue_and_redeliver(ids=[dead.pk]) == 1
    publish(message, consumer="payments")  # a late copy: a duplicate
    assert wait_until(lambda: succeeded() > done + 1, timeout=30), workers.log_tail()
    applied = row()
    assert applied is not None
    assert (applied.status, applied.outcome) == (InboxStatus.DONE, Outcome.APPLIED)
    fresh = get_order_model()._default_manager.get(pk=order.pk)
    assert fresh.version == 1


@pytest.mark.backends("postgresql", "mysql")
def test_a_payment_racing_a_cancel_ends_in_exactly_one_outcome(make_order: Any) -> None:
    """Paid (the cancel refused), or cancelled with the payment kept as money to give back:
    never both, never neither, never silent."""
    import threading

    from django.db import connection

    seen = {"paid": 0, "cancelled": 0}
    for round_no in range(12):
        order = make_order()
        pay = payment(order)
        cancel = {
            "message_id": f"cancel-{order.pk}-{round_no}",
            "type": "order.cancelled",
            "order_id": order.pk,
        }
        outcomes: dict[str, Outcome] = {}
        barrier = threading.Barrier(2)

        def run(
            name: str,
            message: dict[str, Any],
            barrier: threading.Barrier,
            outcomes: dict[str, Outcome],
        ) -> None:
            try:
                barrier.wait()
                outcomes[name] = consume_message(message, consumer="payments")
            finally:
                connection.close()

        threads = [
            threading.Thread(target=run, args=("pay", pay, barrier, outcomes)),
            threading.Thread(target=run, args=("cancel", cancel, barrier, outcomes)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        fresh = get_order_model()._default_manager.get(pk=order.pk)
        assert fresh.version == 1  # one transition, never two
        seen[fresh.status] += 1
        if fresh.status == "paid":
            assert outcomes == {"pay": Outcome.APPLIED, "cancel": Outcome.REJECTED}
        else:
            assert outcomes == {"pay": Outcome.REJECTED, "cancel": Outcome.APPLIED}
            assert inbox(pay).error.endswith("the payment is money to give back")
    print("payment racing a cancel:", seen)
    assert sum(seen.values()) == 12


def test_a_parked_message_that_raises_on_release_is_kept_as_failed(make_order: Any) -> None:
    """Released by its predecessor, its own receiver raises: the predecessor still applies,
    the parked message leaves the park as failed, and its redelivery applies it once."""
    from idempotent_orders.models import ParkedMessage
    from tests.support.messages import shipment

    order = make_order()
    ship = shipment(order)
    assert consume_message(ship, consumer="shipping") is Outcome.PARKED

    def broken_ship(sender: Any, instance: Any, name: str, **kwargs: Any) -> None:
        if name == "ship":
            raise ZeroDivisionError("a bug in the ship receiver")

    post_transition.connect(broken_ship, sender=get_order_model(), weak=False)
    try:
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    finally:
        post_transition.disconnect(broken_ship, sender=get_order_model())
    row = ProcessedMessage.objects.get(consumer="shipping", message_id=ship["message_id"])
    assert row.status == InboxStatus.FAILED
    assert "ZeroDivisionError('a bug in the ship receiver')" in row.error
    assert json.loads(row.body)["payload"] == ship["payload"]
    assert not ParkedMessage.objects.filter(order_id=order.pk).exists()
    assert get_order_model()._default_manager.get(pk=order.pk).status == "paid"
    # Fixed, delivered again: applied once.
    assert consume_message(ship, consumer="shipping") is Outcome.APPLIED
    assert get_order_model()._default_manager.get(pk=order.pk).status == "shipped"
