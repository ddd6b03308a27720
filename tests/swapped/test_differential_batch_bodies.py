"""Transition bodies in one batch chunk, against django-fsm-2 itself and the single road.

A stream of messages for several orders goes three ways: each message's transition called
directly on the first set of orders (fsm-2 and ``save()``, one transaction per call, as a
project runs them without the app), each message through ``consume_message`` on the
second, and the whole stream through one ``consume_batch`` call (one chunk) on the third.
The rows, the rows the bodies wrote, the fsm-2 signals and the inbox must end the same:
a body that raises in the middle of the chunk is kept as failed and runs no other
message's code twice; a condition reads what an earlier message of the same chunk wrote;
``on_error`` moves the order and keeps the message as rejected; receivers write.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from django.db import OperationalError, transaction
from django.test import override_settings
from django_fsm.signals import pre_transition

from idempotent_orders.consuming import batch as batch_module
from idempotent_orders.consuming import writing
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.failures import MessageFailed
from idempotent_orders.consuming.savepoints import Savepoints
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import InboxStatus, Outcome, ProcessedMessage
from idempotent_orders.signals import message_consumed, order_transitioned
from tests.shop.models import ConcurrentFlowOrder, FlowOrder, IntOrder, KeyOrder, Payment
from tests.swapped import test_differential_fsm as fsm_suite
from tests.swapped.test_differential_fsm import (
    CONSUMER,
    Case,
    Signals,
    direct,
    fill,
    new_order,
    snapshot,
)

# The fsm-2 suite's fixtures: its message types, FSMKeyField states and signal recorder.
message_types = fsm_suite.message_types
stages = fsm_suite.stages
signals = fsm_suite.signals

#: ``(order letter, transition, payload)`` in arrival order; ``%`` is the order's tag.
Step = tuple[str, str, dict[str, Any]]

STREAMS: dict[str, tuple[type[Any], list[Step]]] = {
    "flow": (
        FlowOrder,
        [
            ("a", "pay", {"payment_id": "p-%", "amount": "10.00"}),
            ("b", "crash", {}),  # raises in the middle of the chunk
            # The condition reads the Payment row the body above wrote in this chunk.
            ("a", "ship", {"tracking_number": "T-%"}),
            ("c", "pay", {"payment_id": "p-%", "amount": "4.00"}),
            # paid_in_full reads paid_total, which the message above wrote: not yet.
            ("c", "settle_up", {}),
            ("d", "pay", {"payment_id": "p-%", "amount": "10.00"}),
            ("d", "review", {"fail": True}),  # on_error: moved to "failed", rejected
            ("c", "pay", {"payment_id": "q-%", "amount": "6.00"}),
            ("d", "remark", {"text": "after the review"}),
            ("b", "pay", {"payment_id": "p-%", "amount": "1.00"}),
            ("e", "pay", {"payment_id": "p-%", "amount": "1.00"}),
            # The database refuses the body's row (its payment id is taken): failed, alone.
            ("e", "pay", {"payment_id": "p-%", "amount": "9.00"}),
            ("e", "pay", {"payment_id": "q-%", "amount": "9.00"}),
            ("e", "acknowledge", {}),  # a body that calls another transition
        ],
    ),
    # The receiver saves the order itself, twice in the chunk for one order.
    "concurrent": (
        ConcurrentFlowOrder,
        [
            ("a", "pay", {"payment_id": "p-%", "amount": "4.00"}),
            ("b", "pay", {"payment_id": "p-%", "amount": "10.00"}),
            ("a", "pay", {"payment_id": "q-%", "amount": "6.00"}),
            ("a", "ship", {"tracking_number": "T-%"}),
        ],
    ),
    "integer": (
        IntOrder,
        [
            ("a", "submit", {"text": "first"}),
            ("b", "approve", {}),  # not allowed yet: parked, never released
            ("a", "approve", {}),
            ("b", "decline", {}),
        ],
    ),
    "key": (
        KeyOrder,
        [("a", "kpay", {"payment_id": "k-%"}), ("a", "kship", {}), ("b", "kship", {})],
    ),
}


def _messages(steps: list[Step], orders: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "message_id": f"m-{uuid.uuid4().hex}",
            "type": f"diff.{name}",
            "order_id": orders[letter].pk,
            "payload": fill(payload, orders[letter].business_key),
        }
        for letter, name, payload in steps
    ]


class Heard:
    """The app's own signals per order: what was consumed, what transitioned (after commit)."""

    def __init__(self) -> None:
        self.consumed: dict[Any, list[str]] = {}
        self.transitioned: dict[Any, list[tuple[str, Any]]] = {}

    def on_consumed(self, sender: Any, order_id: Any, outcome: Any, **kw: Any) -> None:
        self.consumed.setdefault(order_id, []).append(str(outcome))

    def on_transitioned(self, sender: Any, order: Any, transition: str, **kw: Any) -> None:
        self.transitioned.setdefault(order.pk, []).append((transition, kw["target"]))


@pytest.fixture
def heard() -> Iterator[Heard]:
    recorder = Heard()
    message_consumed.connect(recorder.on_consumed, weak=False)
    order_transitioned.connect(recorder.on_transitioned, weak=False)
    yield recorder
    message_consumed.disconnect(recorder.on_consumed)
    order_transitioned.disconnect(recorder.on_transitioned)


def _orders(model: type[Any], steps: list[Step]) -> dict[str, Any]:
    letters = sorted({step[0] for step in steps})
    return {letter: new_order(Case("stream", model, "")) for letter in letters}


def _single(messages: list[dict[str, Any]]) -> list[Outcome]:
    outcomes = []
    for message in messages:
        try:
            outcomes.append(consume_message(message, consumer=CONSUMER))
        except MessageFailed:
            outcomes.append(Outcome.FAILED)
    return outcomes


def _inbox(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    found = ProcessedMessage.objects.filter(
        consumer=CONSUMER, message_id__in=[m["message_id"] for m in messages]
    ).values_list("message_id", "status", "outcome")
    rows = {m: (s, o) for m, s, o in found}
    return [rows[m["message_id"]] for m in messages]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stream", sorted(STREAMS))
def test_a_chunk_of_bodies_ends_as_the_direct_calls(
    stream: str, message_types: None, stages: None, signals: Signals, heard: Heard
) -> None:
    model, steps = STREAMS[stream]
    oracle, single, batch = _orders(model, steps), _orders(model, steps), _orders(model, steps)
    signals.seen.clear()
    for message, (letter, name, _) in zip(_messages(steps, oracle), steps, strict=True):
        direct(oracle[letter], name, message["payload"])
        oracle[letter] = model.objects.get(pk=oracle[letter].pk)
    single_messages, batch_messages = _messages(steps, single), _messages(steps, batch)
    with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL=model._meta.label):
        single_outcomes = _single(single_messages)
        batch_outcomes = consume_batch(batch_messages, consumer=CONSUMER)
    assert batch_outcomes == single_outcomes
    assert _inbox(batch_messages) == _inbox(single_messages)
    for letter in oracle:
        expected = snapshot(oracle[letter])
        for path, orders in (("single", single), ("batch", batch)):
            assert snapshot(orders[letter]) == expected, (path, letter)
            # Each fsm-2 signal once, as the direct calls sent it: none sent twice by a
            # chunk that ran again, none missing for a message that raised.
            seen = signals.seen.get(orders[letter].pk, [])
            assert seen == signals.seen.get(oracle[letter].pk, []), (path, letter)
        pk_single, pk_batch = single[letter].pk, batch[letter].pk
        assert sorted(heard.consumed.get(pk_batch, [])) == sorted(heard.consumed.get(pk_single, []))
        assert heard.transitioned.get(pk_batch) == heard.transitioned.get(pk_single), letter
    for message, outcome in zip(batch_messages, batch_outcomes, strict=True):
        row = ProcessedMessage.objects.get(consumer=CONSUMER, message_id=message["message_id"])
        if outcome is Outcome.FAILED:
            assert row.status == InboxStatus.FAILED
            assert "Error(" in row.error
            assert " at " in row.error
            assert json.loads(row.body)["payload"] == message["payload"]
    if stream == "flow":
        assert Outcome.FAILED in batch_outcomes  # the stream does what it says
        assert batch_outcomes.count(Outcome.REJECTED) >= 1
        assert Payment.objects.filter(order__in=batch.values()).count() == 7


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stream", sorted(STREAMS))
def test_on_the_save_road_a_chunk_ends_as_the_direct_calls(
    stream: str, message_types: None, stages: None, signals: Signals, heard: Heard
) -> None:
    """The same streams with a ``post_save`` receiver on the model that reads its order
    back through the ORM: every transition is a ``save()``, whose UPDATE the chunk holds
    for its next text (on PostgreSQL and MariaDB), here the receiver's read. The three
    roads end alike, and each read saw the row as that ``save()`` wrote it: the same
    states as the direct calls, the same states and versions on the two roads."""
    from django.db.models.signals import post_save

    from idempotent_orders.consuming.graph import state_field
    from idempotent_orders.consuming.running import road

    model, steps = STREAMS[stream]
    column = state_field(model).attname
    read: dict[Any, list[tuple[Any, int]]] = {}

    def read_back(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
        if not created:
            row = model.objects.filter(pk=instance.pk).values_list(column, "version").get()
            read.setdefault(instance.pk, []).append(row)

    post_save.connect(read_back, sender=model, weak=False, dispatch_uid="diff-save-road")
    try:
        assert road(model, steps[0][1])[0] == "save"
        test_a_chunk_of_bodies_ends_as_the_direct_calls(
            stream, message_types, stages, signals, heard
        )
    finally:
        post_save.disconnect(sender=model, dispatch_uid="diff-save-road")
    # The orders of the three roads were made in that order, each road's letters sorted.
    letters = sorted({step[0] for step in steps})
    by_road = [sorted(pk for pk in read if pk in pks) for pks in _road_pks(model, len(letters))]
    assert any(by_road), read
    oracle, single, batch = ([read[pk] for pk in pks] for pks in by_road)
    assert batch == single
    assert [[state for state, _ in seen] for seen in batch] == [
        [state for state, _ in seen] for seen in oracle
    ]


def _road_pks(model: type[Any], per_road: int) -> list[list[Any]]:
    """The primary keys of the last three roads' orders, oldest road first."""
    pks = list(model.objects.order_by("-pk").values_list("pk", flat=True)[: per_road * 3])
    pks.reverse()
    return [pks[i * per_road : (i + 1) * per_road] for i in range(3)]


class _Deadlock(Exception):
    sqlstate = "40P01"


def _deadlock() -> OperationalError:
    error = OperationalError("deadlock detected")
    error.__cause__ = _Deadlock()
    return error


@pytest.mark.django_db(transaction=True)
def test_a_chunk_run_again_after_a_deadlock_sends_what_the_single_road_sends(
    message_types: None, signals: Signals, heard: Heard
) -> None:
    """The database rolled the transaction back after the bodies ran: both roads run it
    again, and the receivers with it (their writes were rolled back too), so fsm-2's
    signals come once per attempt on both; what is sent after commit comes once."""
    steps: list[Step] = [("a", "pay", {"payment_id": "p-%", "amount": "10.00"})]
    single, batch = _orders(FlowOrder, steps), _orders(FlowOrder, steps)
    signals.seen.clear()
    once = {"single": True, "batch": True}

    def failing(real: Any, road: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if once[road]:
                once[road] = False
                raise _deadlock()
            return real(*args, **kwargs)

        return call

    with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="shop.FlowOrder"):
        # The single road's UPDATE: the ORM's or the second text (writing._finish).
        with (
            mock.patch.object(writing, "commit", failing(writing.commit, "single")),
            mock.patch.object(writing, "_finish", failing(writing._finish, "single")),
        ):
            assert _single(_messages(steps, single)) == [Outcome.APPLIED]
        with mock.patch.object(
            batch_module, "update_orders", failing(batch_module.update_orders, "batch")
        ):
            assert consume_batch(_messages(steps, batch), consumer=CONSUMER) == [Outcome.APPLIED]
    assert once == {"single": False, "batch": False}
    seen_single = signals.seen[single["a"].pk]
    assert [s[0] for s in seen_single] == ["pre", "post", "pre", "post"]
    assert signals.seen[batch["a"].pk] == seen_single
    assert snapshot(batch["a"]) == snapshot(single["a"])
    assert heard.consumed[batch["a"].pk] == heard.consumed[single["a"].pk] == ["applied"]
    assert heard.transitioned[batch["a"].pk] == heard.transitioned[single["a"].pk]
    assert len(heard.transitioned[batch["a"].pk]) == 1


def _charges(order: Any) -> dict[str, Any]:
    """:func:`snapshot` with the charge ids as their stream names them (``CH``, ``CH2``)."""
    taken = snapshot(order)
    return {**taken, "payments": [(p.split("-")[0], a) for p, a in taken["payments"]]}


def _named(signals: Signals, order: Any) -> list[tuple[Any, ...]]:
    """The order's fsm-2 signals, the charge ids as the stream names them."""
    return [
        (*s[:5], {k: str(v).split("-")[0] for k, v in s[5].items()}, s[6])
        for s in signals.seen.get(order.pk, [])
    ]


@pytest.mark.django_db(transaction=True)
def test_a_payment_spent_within_a_chunk_of_bodies_is_spent_once(
    message_types: None, signals: Signals
) -> None:
    """A money message's payment is spent before its body runs, as on the single road: a
    second message with the same payment is a duplicate on its order and money to give
    back on another, and its body never runs (no fsm-2 signal, no Payment row)."""
    from idempotent_orders.consuming import registry

    registry.register("diff.money", transition="pay", money=True)
    steps: list[Step] = [
        ("a", "money", {"payment_id": "CH", "amount": "4.00"}),
        ("b", "money", {"payment_id": "CH", "amount": "10.00"}),  # another order: refund
        ("a", "money", {"payment_id": "CH", "amount": "4.00"}),  # same order: duplicate
        ("c", "crash", {}),
        ("c", "money", {"payment_id": "CH2", "amount": "10.00"}),
        ("b", "money", {"payment_id": "CH3", "amount": "10.00"}),
    ]
    runs = {}
    for road in ("single", "batch"):
        orders = _orders(FlowOrder, steps)
        messages = _messages(steps, orders)
        for message in messages:  # one charge id per road, shared by its orders
            if "payment_id" in message["payload"]:
                message["payload"]["payment_id"] += f"-{orders['a'].business_key}"
        with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="shop.FlowOrder"):
            if road == "single":
                outcomes = _single(messages)
            else:
                outcomes = consume_batch(messages, consumer=CONSUMER)
        runs[road] = (orders, messages, outcomes)
    (s_orders, s_messages, s_outcomes), (b_orders, b_messages, b_outcomes) = (
        runs["single"],
        runs["batch"],
    )
    assert b_outcomes == s_outcomes
    assert s_outcomes[:3] == [Outcome.APPLIED, Outcome.REJECTED, Outcome.DUPLICATE]
    assert _inbox(b_messages) == _inbox(s_messages)
    for letter in s_orders:
        assert _charges(b_orders[letter]) == _charges(s_orders[letter]), letter
        assert _named(signals, b_orders[letter]) == _named(signals, s_orders[letter]), letter
    from idempotent_orders.models import SpentPayment

    for road, (orders, _, _) in runs.items():
        spent = sorted(
            (p.split("-")[0], o)
            for p, o in SpentPayment.objects.filter(
                order_id__in=[o.pk for o in orders.values()]
            ).values_list("payment_id", "order_id")
        )
        by_letter = {o.pk: letter for letter, o in orders.items()}
        runs[road] = sorted((p, by_letter[o]) for p, o in spent)  # type: ignore[assignment]
    assert runs["batch"] == runs["single"] == [("CH", "a"), ("CH2", "c"), ("CH3", "b")]


@pytest.mark.django_db(transaction=True)
def test_a_body_that_sends_no_statement_takes_no_savepoint(message_types: None) -> None:
    """The savepoint is taken at the first statement a message's code sends: ``remark``
    only sets a field (none), ``pay`` records a Payment row (one each)."""
    steps: list[Step] = [
        ("a", "remark", {"text": "one"}),
        ("b", "remark", {"text": "two"}),
        ("c", "pay", {"payment_id": "p-%", "amount": "4.00"}),
        ("d", "pay", {"payment_id": "p-%", "amount": "4.00"}),
    ]
    orders = _orders(FlowOrder, steps)
    messages = _messages(steps, orders)
    # Counted where they are made: a SAVEPOINT may go in the text of the statement that
    # takes it, which query logging shows as the code sent it.
    taken = mock.patch.object(Savepoints, "texts", autospec=True, side_effect=Savepoints.texts)
    with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="shop.FlowOrder"):
        with taken as remarks:
            assert consume_batch(messages[:2], consumer=CONSUMER) == [Outcome.APPLIED] * 2
        with taken as payments:
            assert consume_batch(messages[2:], consumer=CONSUMER) == [Outcome.APPLIED] * 2
    assert remarks.call_count == 0
    assert payments.call_count == 2
    assert FlowOrder.objects.get(pk=orders["b"].pk).note == "two"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("road", ["single", "batch"])
def test_what_a_failed_message_registered_on_commit_is_dropped(
    road: str, message_types: None
) -> None:
    """A receiver's ``on_commit`` callback goes with its message's rolled-back work, as
    a direct call's goes with its transaction; the chunk's other messages keep theirs."""
    ran: list[str] = []

    def receiver(sender: Any, instance: Any, name: str, **kw: Any) -> None:
        transaction.on_commit(lambda: ran.append(name))

    steps: list[Step] = [("a", "remark", {"text": "kept"}), ("b", "crash", {})]
    orders = _orders(FlowOrder, steps)
    messages = _messages(steps, orders)
    pre_transition.connect(receiver, weak=False)
    try:
        with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="shop.FlowOrder"):
            if road == "single":
                outcomes = _single(messages)
            else:
                outcomes = consume_batch(messages, consumer=CONSUMER)
    finally:
        pre_transition.disconnect(receiver)
    assert outcomes == [Outcome.APPLIED, Outcome.FAILED]
    assert ran == ["remark"]


@pytest.mark.django_db(transaction=True)
def test_a_body_that_writes_null_writes_it_in_a_chunk(
    message_types: None, django_user_model: Any
) -> None:
    """NULL in the chunk's one UPDATE means "unchanged" except where a body wrote it."""
    from idempotent_orders.consuming import registry

    registry.register("diff.unassign", transition="unassign")
    buyer = django_user_model.objects.create(username=f"u-{uuid.uuid4().hex[:8]}")
    steps: list[Step] = [("a", "unassign", {}), ("b", "remark", {"text": "kept"})]
    orders = _orders(FlowOrder, steps)
    FlowOrder.objects.filter(pk__in=[o.pk for o in orders.values()]).update(customer=buyer)
    with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="shop.FlowOrder"):
        outcomes = consume_batch(_messages(steps, orders), consumer=CONSUMER)
    assert outcomes == [Outcome.APPLIED, Outcome.APPLIED]
    assert FlowOrder.objects.get(pk=orders["a"].pk).customer_id is None
    assert FlowOrder.objects.get(pk=orders["b"].pk).customer_id == buyer.pk
