"""A message consumed inside the project's own transaction (``transaction.atomic()`` around
``consume_message``): on PostgreSQL and MariaDB the road's two texts, the message's
savepoint opened at the head of the first and released at the end of the last; what they
decline is rolled back to it, and the caller's transaction goes on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from django.db import ProgrammingError, connection, transaction
from django_fsm.signals import pre_transition

from idempotent_orders import stats
from idempotent_orders.consuming import writing
from idempotent_orders.consuming.backends import backend
from idempotent_orders.consuming.failures import MessageFailed
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.fulfilment import fulfilment_message_id
from idempotent_orders.models import (
    InboxStatus,
    Order,
    OrderStatus,
    OutboxMessage,
    Outcome,
    ProcessedMessage,
    SpentPayment,
)
from idempotent_orders.signals import message_consumed
from tests.support.messages import payment
from tests.support.round_trips import round_trips

pytestmark = [
    pytest.mark.backends("postgresql", "mysql"),
    pytest.mark.django_db(transaction=True),
]


def _receiver(sender: Any, **kwargs: Any) -> None:
    """A pre_transition receiver: the order's transition must be run by its own method."""


@pytest.fixture
def with_a_receiver() -> Iterator[None]:
    pre_transition.connect(_receiver, sender=Order)
    yield
    pre_transition.disconnect(_receiver, sender=Order)


def _declined(*args: Any, **kwargs: Any) -> None:
    """The two texts standing aside: the road reads, then writes one statement at a time."""
    return None


def _kept(order: Order) -> dict[str, Any]:
    """What consuming a payment left of ``order``, without ids and times (the order's own
    id written as ``<pk>``)."""
    order.refresh_from_db()
    inbox = ProcessedMessage.objects.filter(order_id=order.pk)
    spent = SpentPayment.objects.filter(order_id=order.pk).values_list("payment_id", flat=True)
    own = str(order.pk)
    return {
        "order": (order.status, order.version, order.payment_id.replace(own, "<pk>")),
        "inbox": sorted(inbox.values_list("consumer", "outcome", "status", "error")),
        "spent": [payment_id.replace(own, "<pk>") for payment_id in spent],
    }


def _opens(texts: list[str]) -> str:
    return texts[0].strip('"')


def _ends(texts: list[str]) -> str:
    return texts[-1].strip('"')


def _paid_inside(
    alone: Order, begun: Order, fresh: Order
) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Pay ``begun`` and ``fresh`` each inside a caller's transaction (one that has read
    ``alone`` first, one that has sent nothing yet), then write to each after the payment
    in that transaction; the round trips and the texts each payment sent."""
    counted: dict[str, int] = {}
    sent: dict[str, list[str]] = {}
    for name, order in (("begun", begun), ("fresh", fresh)):
        texts: list[str] = []
        with transaction.atomic():
            if name == "begun":
                list(Order.objects.filter(pk=alone.pk).values_list("pk"))
            with round_trips(texts) as trips:
                assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
                counted[name] = trips()
            Order.objects.filter(pk=order.pk).update(carrier=f"after {name}")
        sent[name] = texts
    return counted, sent


@pytest.mark.usefixtures("with_a_receiver")
def test_a_message_in_a_callers_transaction_takes_two_texts_and_a_savepoint(
    make_order, fulfil
) -> None:
    """Two round trips, whether the caller's transaction has sent something already or
    not; the same order, inbox row, spent payment and outbox row as outside it; the caller's
    later statements in the same transaction."""
    alone, begun, fresh, usual = (make_order() for _ in range(4))
    assert consume_message(payment(alone), consumer="payments") is Outcome.APPLIED
    counted, sent = _paid_inside(alone, begun, fresh)
    standing_aside = mock.patch.object(writing, "_in_two_texts", _declined)
    with transaction.atomic(), standing_aside, round_trips() as trips:
        assert consume_message(payment(usual), consumer="payments") is Outcome.APPLIED
        counted["usual"] = trips()
    assert counted["begun"] == counted["fresh"] == 2, sent
    assert counted["usual"] > 2
    savepoint = "SAVEPOINT "
    begin = "BEGIN; " if connection.vendor == "postgresql" else ""
    assert _opens(sent["begun"]).startswith(savepoint), sent
    assert _opens(sent["fresh"]).startswith(f"{begin}{savepoint}"), sent
    for texts in sent.values():
        assert "RELEASE SAVEPOINT " in _ends(texts), texts
        assert "COMMIT" not in " ".join(texts), texts
    wanted = _kept(alone)
    for order in (begun, fresh, usual):
        assert _kept(order) == wanted
        assert OutboxMessage.objects.filter(message_id=fulfilment_message_id(order.pk)).exists()
    after = dict(Order.objects.filter(pk__in=[begun.pk, fresh.pk]).values_list("pk", "carrier"))
    assert after == {begun.pk: "after begun", fresh.pk: "after fresh"}


@pytest.mark.usefixtures("with_a_receiver")
def test_a_callers_rollback_takes_the_message_with_it(make_order, fulfil) -> None:
    """The message's writes and its after-commit work (the publish, the memory of the id)
    go with the caller's transaction: rolled back, the redelivery applies it."""
    order = make_order()
    message = payment(order)

    class Undone(Exception):
        pass

    def consumed_then_undone() -> None:
        with transaction.atomic():
            assert consume_message(message, consumer="payments") is Outcome.APPLIED
            order.refresh_from_db()
            assert order.status == OrderStatus.PAID
            raise Undone

    with pytest.raises(Undone):
        consumed_then_undone()
    assert _kept(order) == {"order": (OrderStatus.PENDING_PAYMENT, 0, ""), "inbox": [], "spent": []}
    assert not OutboxMessage.objects.exists()
    assert consume_message(message, consumer="payments") is Outcome.APPLIED
    order.refresh_from_db()
    assert (order.status, order.version) == (OrderStatus.PAID, 1)


@pytest.mark.usefixtures("with_a_receiver")
def test_what_the_texts_decline_in_a_callers_transaction_is_rolled_back_to_the_savepoint(
    make_order,
) -> None:
    """A refused payment, a charge that paid another order and a copy: each first text is
    rolled back to its savepoint (the usual road then claims the message itself, which a
    claim left behind would make a duplicate), and the caller's transaction commits its
    own writes and the verdicts."""
    paid_first, refused, other, kept = (make_order() for _ in range(4))
    Order.objects.filter(pk=refused.pk).update(status=OrderStatus.CANCELLED)
    texts_class = type(backend().texts())
    real = texts_class.claim_and_read
    first_texts: list[Any] = []

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        first_texts.append(args[-1])
        return real(self, *args, **kwargs)

    charge = f"ch-{paid_first.pk}"
    first = payment(paid_first, payment_id=charge)
    outcomes = []
    refusal_texts: list[str] = []
    with mock.patch.object(texts_class, "claim_and_read", spy), transaction.atomic():
        Order.objects.filter(pk=kept.pk).update(carrier="before")
        outcomes.append(consume_message(first, consumer="payments"))
        with round_trips(refusal_texts) as trips:
            outcomes.append(consume_message(payment(refused), consumer="payments"))
            trips()
        outcomes.append(consume_message(payment(other, payment_id=charge), consumer="payments"))
        outcomes.append(consume_message(first, consumer="payments"))
        Order.objects.filter(pk=kept.pk).update(tracking_number="after")
    assert outcomes == [Outcome.APPLIED, Outcome.REJECTED, Outcome.REJECTED, Outcome.DUPLICATE]
    # Each took a first text, the copy too: its id is remembered once the caller commits.
    assert len(first_texts) == 4
    # The refused payment's first text is rolled back to its savepoint, released in the
    # same text; then the road claims it one statement at a time.
    undone = [t for t in refusal_texts if "ROLLBACK TO SAVEPOINT" in t]
    assert len(undone) == 1, refusal_texts
    assert "RELEASE SAVEPOINT" in undone[0], refusal_texts
    after = refusal_texts[refusal_texts.index(undone[0]) + 1]
    assert not after.strip('"').startswith("RELEASE SAVEPOINT"), refusal_texts
    kept.refresh_from_db()
    assert (kept.carrier, kept.tracking_number) == ("before", "after")
    refusal = ProcessedMessage.objects.get(order_id=refused.pk)
    assert (refusal.outcome, refusal.status) == (Outcome.REJECTED, InboxStatus.REJECTED)
    assert not SpentPayment.objects.filter(order_id=refused.pk).exists()
    rejected = ProcessedMessage.objects.get(order_id=other.pk)
    assert rejected.error.startswith(f"payment {charge} already paid order {paid_first.pk}")
    assert list(SpentPayment.objects.values_list("payment_id", "order_id")) == [
        (charge, paid_first.pk)
    ]
    other.refresh_from_db()
    assert (other.status, other.version) == (OrderStatus.PENDING_PAYMENT, 0)
    assert ProcessedMessage.objects.filter(order_id=paid_first.pk).count() == 1


@pytest.mark.backends("postgresql")
@pytest.mark.usefixtures("with_a_receiver")
def test_a_first_text_the_driver_refuses_leaves_the_callers_transaction_usable(
    make_order,
) -> None:
    """Refused before it was sent, the first text made no savepoint: nothing is rolled back
    to one (a rollback to a savepoint that does not exist would abort the caller's
    transaction); the failure is kept in the caller's transaction, which commits."""
    from idempotent_orders.consuming.backends import postgresql

    order, kept = make_order(), make_order()
    message = payment(order)
    real = postgresql.send_text
    calls: list[int] = []

    def refused(*args: Any, **kwargs: Any) -> int:
        calls.append(1)
        if len(calls) == 1:
            raise ProgrammingError("cannot adapt type 'Thing'")
        return real(*args, **kwargs)

    with mock.patch.object(postgresql, "send_text", refused), transaction.atomic():
        Order.objects.filter(pk=kept.pk).update(carrier="before")
        with pytest.raises(MessageFailed):
            consume_message(message, consumer="payments")
        Order.objects.filter(pk=kept.pk).update(tracking_number="after")
    kept.refresh_from_db()
    assert (kept.carrier, kept.tracking_number) == ("before", "after")
    row = ProcessedMessage.objects.get(consumer="payments", message_id=message["message_id"])
    assert row.status == InboxStatus.FAILED
    assert "cannot adapt type" in row.error
    assert calls == [1]


@pytest.mark.backends("postgresql")
def test_the_one_statement_runs_in_a_callers_transaction_in_one_text_with_its_savepoint(
    make_order, fulfil
) -> None:
    """A message with nothing of the project's to run: its one statement, in one text with
    the savepoint's statements (after ``BEGIN`` when the caller's transaction has sent
    nothing yet); one the order refuses is rolled back to the savepoint and the road reads
    it and says why, in the same caller's transaction."""
    alone, begun, fresh, refused = (make_order() for _ in range(4))
    Order.objects.filter(pk=refused.pk).update(status=OrderStatus.CANCELLED)
    assert consume_message(payment(alone), consumer="payments") is Outcome.APPLIED
    counted, sent = _paid_inside(alone, begun, fresh)
    assert counted == {"begun": 1, "fresh": 1}, sent
    assert _opens(sent["begun"]).startswith("SAVEPOINT "), sent
    assert _opens(sent["fresh"]).startswith("BEGIN; SAVEPOINT "), sent
    for texts in sent.values():
        assert "EXECUTE " in texts[0], texts
        assert "RELEASE SAVEPOINT " in _ends(texts), texts
    wanted = _kept(alone)
    for order in (begun, fresh):
        assert _kept(order) == wanted
        assert OutboxMessage.objects.filter(message_id=fulfilment_message_id(order.pk)).exists()
    after = dict(Order.objects.filter(pk__in=[begun.pk, fresh.pk]).values_list("pk", "carrier"))
    assert after == {begun.pk: "after begun", fresh.pk: "after fresh"}
    with transaction.atomic():
        assert consume_message(payment(refused), consumer="payments") is Outcome.REJECTED
        Order.objects.filter(pk=refused.pk).update(carrier="kept")
    refused.refresh_from_db()
    assert (refused.status, refused.version, refused.carrier) == (
        OrderStatus.CANCELLED,
        0,
        "kept",
    )
    refusal = ProcessedMessage.objects.get(order_id=refused.pk)
    assert (refusal.outcome, refusal.status) == (Outcome.REJECTED, InboxStatus.REJECTED)
    assert not SpentPayment.objects.filter(order_id=refused.pk).exists()
    assert not OutboxMessage.objects.filter(message_id=fulfilment_message_id(refused.pk)).exists()


@pytest.mark.parametrize("listening", ["receiver", "counters"])
def test_message_consumed_comes_after_the_callers_commit_and_never_for_its_rollback(
    make_order, listening: str
) -> None:
    """``message_consumed`` (and the app's own counting, where only it listens) is sent once
    the caller's transaction commits, as ``order_transitioned`` is; a rolled-back one never
    reports the message, and its redelivery does."""
    heard: list[tuple[str, bool]] = []

    def receiver(sender: Any, message_id: str, outcome: Any, **kwargs: Any) -> None:
        heard.append((str(outcome), connection.in_atomic_block))

    undone, kept = make_order(), make_order()
    messages = {order.pk: payment(order) for order in (undone, kept)}
    if listening == "receiver":
        message_consumed.connect(receiver, weak=False, dispatch_uid="test-consumed-after")
    counted = stats.local().get("outcome:applied", 0)

    class Undone(Exception):
        pass

    def consumed_then_undone() -> None:
        with transaction.atomic():
            assert consume_message(messages[undone.pk], consumer="payments") is Outcome.APPLIED
            raise Undone

    try:
        with pytest.raises(Undone):
            consumed_then_undone()
        after_rollback = (list(heard), stats.local().get("outcome:applied", 0) - counted)
        with transaction.atomic():
            assert consume_message(messages[kept.pk], consumer="payments") is Outcome.APPLIED
            before_commit = (list(heard), stats.local().get("outcome:applied", 0) - counted)
        after_commit = (list(heard), stats.local().get("outcome:applied", 0) - counted)
        assert consume_message(messages[undone.pk], consumer="payments") is Outcome.APPLIED
    finally:
        message_consumed.disconnect(dispatch_uid="test-consumed-after")
    assert after_rollback == ([], 0)
    assert before_commit == ([], 0)
    if listening == "receiver":
        assert after_commit == ([("applied", False)], 1)
        assert heard == [("applied", False), ("applied", False)]
    else:
        assert after_commit == ([], 1)
    assert stats.local().get("outcome:applied", 0) - counted == 2
