"""django-fsm-2 itself is the oracle: a message runs the model's own transition.

For each case three orders start equal. On the first the transition method is
called directly and the order saved, as a project does without this app (in a
transaction, rolled back when the call raises); the second consumes the message
with ``consume_message``, the third with ``consume_batch``. All three must end
with the same row, the same related rows and the same fsm-2 signals (with the
same arguments), and the consumer's outcome must say what the direct call did:
applied, refused (the row unchanged), moved to the ``on_error`` state, or
raised (kept as a failed inbox row, nothing else written).

The shapes are proxies of ``shop.Order`` (tests/shop/models.py), one per state
field: ``FlowOrder`` (a state field without choices: bodies, conditions,
``on_error``, ``RETURN_VALUE``, ``GET_STATE``, targetless, ``"*"`` and ``"+"``),
``IntOrder`` (``FSMIntegerField``) and ``KeyOrder`` (``FSMKeyField``).
"""

from __future__ import annotations

import inspect
import json
import random
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
from django.db import models, transaction
from django.test import override_settings
from django_fsm import TransitionNotAllowed
from django_fsm.signals import post_transition, pre_transition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idempotent_orders.consuming import registry
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.failures import MessageFailed
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import InboxStatus, Outcome, ProcessedMessage
from tests.shop.models import (
    ConcurrentFlowOrder,
    FlowOrder,
    IntOrder,
    KeyOrder,
    Level,
    Payment,
    Stage,
)

CONSUMER = "diff"
#: Columns the app owns (or that differ by construction): left out of the comparison.
OWN = {"id", "business_key", "version", "last_seq", "has_parked", "updated_at"}


@dataclass(frozen=True)
class Case:
    id: str
    model: type[models.Model]
    name: str
    #: ``%`` in a string is replaced by a per-order tag (payment ids are unique).
    payload: dict[str, Any] = field(default_factory=dict)
    #: Transitions called directly on every order first: ``(name, kwargs)``.
    setup: tuple[tuple[str, dict[str, Any]], ...] = ()
    amount: str = "10.00"


PAY = ("pay", {"payment_id": "setup-%", "amount": "10.00"})
PART = ("pay", {"payment_id": "setup-%", "amount": "4.00"})

CASES = [
    # A body that records a payment row and a total; RETURN_VALUE picks the target.
    Case("body-row-return-value-full", FlowOrder, "pay", {"payment_id": "p-%", "amount": "10.00"}),
    Case("body-row-return-value-part", FlowOrder, "pay", {"payment_id": "p-%", "amount": "4.00"}),
    # A self-loop: a second partial payment from part_paid back to part_paid.
    Case("self-loop-partial", FlowOrder, "pay", {"payment_id": "p-%", "amount": "1.00"}, (PART,)),
    Case("partial-completes", FlowOrder, "pay", {"payment_id": "p-%", "amount": "6.00"}, (PART,)),
    # Extra payload keys the method does not take are not passed.
    Case(
        "extra-payload-keys",
        FlowOrder,
        "pay",
        {"payment_id": "p-%", "amount": "10.00", "currency": "EUR", "psp": "x"},
    ),
    # A condition that reads rows an earlier body wrote.
    Case("condition-reads-body-rows", FlowOrder, "ship", {"tracking_number": "T-%"}, (PAY,)),
    Case("not-a-source", FlowOrder, "ship", {"tracking_number": "T-%"}),
    # "+" (ANY_OTHER_STATE) and "*" (ANY_STATE) on a field without choices.
    Case("any-other-state", FlowOrder, "cancel", {"reason": "customer"}, (PAY,)),
    Case("any-other-state-at-target", FlowOrder, "cancel", {}, (("cancel", {}),)),
    Case("targetless-any-state", FlowOrder, "remark", {"text": "gift wrap"}, (PAY,)),
    # on_error: the body raised, fsm-2 moved the order to the error state.
    Case("on-error", FlowOrder, "review", {"fail": True}, (PAY,)),
    Case("on-error-not-raised", FlowOrder, "review", {"fail": False}, (PAY,)),
    # A body that raises without on_error.
    Case("body-raises", FlowOrder, "crash"),
    # A body whose row the database refuses (payment ids are unique).
    Case("database-refuses", FlowOrder, "pay", {"payment_id": "dup", "amount": "1.00"}),
    # GET_STATE: a function of the arguments picks the target.
    Case("get-state-express", FlowOrder, "route", {"express": True}, (PAY,)),
    Case("get-state-standard", FlowOrder, "route", {}, (PAY,)),
    Case("condition-fails", FlowOrder, "settle_up", {}, (PART,)),
    # Targetless, its body calling another transition: the state is the inner one's.
    Case("targetless-calls-another", FlowOrder, "acknowledge", {}, (PAY,)),
    # ConcurrentTransitionMixin (a receiver saves the instance: see the fixture).
    Case("concurrent-mixin", ConcurrentFlowOrder, "pay", {"payment_id": "p-%", "amount": "10.00"}),
    # FSMIntegerField.
    Case("integer-state", IntOrder, "submit", {"text": "hello"}),
    Case("integer-state-second", IntOrder, "approve", {}, (("submit", {}),)),
    Case("integer-state-no-body", IntOrder, "decline", {}, (("submit", {}),)),
    Case("integer-state-not-allowed", IntOrder, "approve"),
    # FSMKeyField.
    Case("key-state", KeyOrder, "kpay", {"payment_id": "k-%"}),
    Case("key-state-no-body", KeyOrder, "kship", {}, (("kpay", {"payment_id": "s-%"}),)),
    Case("key-state-not-allowed", KeyOrder, "kship"),
]

#: How a direct call ended.
APPLIED, REFUSED, ON_ERROR, RAISED = "applied", "refused", "on_error", "raised"


@pytest.fixture
def message_types() -> Iterator[None]:
    names = {c.name for c in CASES} | {"pay", "ship", "cancel", "remark", "settle_up"}
    saved = dict(registry._registry)
    for name in names:
        registry.register(f"diff.{name}", transition=name)
    yield
    registry._registry.clear()
    registry._registry.update(saved)


@pytest.fixture
def stages() -> None:
    for name in ("new", "paid", "shipped", "cancelled"):
        Stage.objects.get_or_create(id=name)


class Signals:
    """Every fsm-2 signal sent for one order, as comparable tuples."""

    def __init__(self) -> None:
        self.seen: dict[Any, list[tuple[Any, ...]]] = {}

    def receiver(self, kind: str) -> Callable[..., None]:
        def receive(sender: Any, instance: Any, **kw: Any) -> None:
            tag = instance.business_key
            exc = kw.get("exception")
            kwargs = {k: _plain(v, tag) for k, v in kw["method_kwargs"].items()}
            self.seen.setdefault(instance.pk, []).append(
                (
                    kind,
                    kw["name"],
                    kw["source"],
                    type(kw["source"]).__name__,
                    kw["target"],
                    kwargs,
                    type(exc).__name__ if exc else None,
                )
            )
            if kind == "post" and kw["name"] == "pay" and exc is None:
                # A receiver that writes on the instance (kept with the transition)...
                instance.note = f"receipt for {kw['target']}"
                if isinstance(instance, ConcurrentFlowOrder):
                    instance.save()  # ...and one that saves it itself.

        return receive


@pytest.fixture
def signals() -> Iterator[Signals]:
    recorder = Signals()
    pre, post = recorder.receiver("pre"), recorder.receiver("post")
    pre_transition.connect(pre, weak=False)
    post_transition.connect(post, weak=False)
    yield recorder
    pre_transition.disconnect(pre)
    post_transition.disconnect(post)


def _plain(value: Any, tag: str) -> Any:
    if isinstance(value, str):
        return value.replace(tag, "%")
    if isinstance(value, Decimal):
        return str(value)
    return value


def fill(payload: dict[str, Any], tag: str) -> dict[str, Any]:
    return {k: v.replace("%", tag) if isinstance(v, str) else v for k, v in payload.items()}


def new_order(case: Case) -> Any:
    tag = uuid.uuid4().hex[:10]
    extra = {"kstate_id": "new"} if case.model is KeyOrder else {}
    order = case.model.objects.create(
        business_key=tag, amount=Decimal(case.amount), currency="EUR", **extra
    )
    for name, kwargs in case.setup:
        order = type(order).objects.get(pk=order.pk)
        getattr(order, name)(**fill(kwargs, tag))
        order.save()
    return type(order).objects.get(pk=order.pk)


def accepted(order: Any, name: str, payload: dict[str, Any]) -> dict[str, Any]:
    """What a project's own code passes: the arguments the method names."""
    taken = inspect.signature(getattr(type(order), name)).parameters
    return {k: v for k, v in payload.items() if k in taken}


def direct(order: Any, name: str, kwargs: dict[str, Any]) -> str:
    """The oracle: fsm-2's call and save(), in a transaction, as a project runs it."""
    kwargs = accepted(order, name, kwargs)
    field = order._meta.get_field(order.state_field_name)
    try:
        with transaction.atomic():
            source = field.get_state(order)
            try:
                getattr(order, name)(**kwargs)
            except TransitionNotAllowed:
                raise
            except Exception:
                on_error = getattr(type(order), name)._django_fsm.exception_state(source)
                if on_error is None:
                    raise
                order.save()
                return ON_ERROR
            order.save()
            return APPLIED
    except TransitionNotAllowed:
        return REFUSED
    except Exception:
        return RAISED


def snapshot(order: Any) -> dict[str, Any]:
    model = type(order)
    row = model.objects.filter(pk=order.pk).values(
        *[f.attname for f in model._meta.concrete_fields if f.attname not in OWN]
    )[0]
    tag = order.business_key
    payments = sorted(
        (_plain(p, tag), str(a))
        for p, a in Payment.objects.filter(order_id=order.pk).values_list("payment_id", "amount")
    )
    return {"row": {k: _plain(v, tag) for k, v in row.items()}, "payments": payments}


def consumed(order: Any, case: Case, batch: bool) -> Outcome | str:
    message = {
        "message_id": f"m-{uuid.uuid4().hex}",
        "type": f"diff.{case.name}",
        "order_id": order.pk,
        "payload": fill(case.payload, order.business_key),
    }
    if batch:
        return consume_batch([message], consumer=CONSUMER)[0]
    try:
        return consume_message(message, consumer=CONSUMER)
    except MessageFailed:
        return Outcome.FAILED


EXPECTED: dict[str, set[Outcome]] = {
    APPLIED: {Outcome.APPLIED},
    ON_ERROR: {Outcome.REJECTED},
    REFUSED: {Outcome.REJECTED, Outcome.PARKED, Outcome.STALE, Outcome.DUPLICATE},
    RAISED: {Outcome.FAILED},
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_message_does_what_the_direct_call_does(
    case: Case, message_types: None, stages: None, signals: Signals
) -> None:
    label = case.model._meta.label
    oracle, single, batch = new_order(case), new_order(case), new_order(case)
    if case.id == "database-refuses":
        Payment.objects.create(order=oracle, payment_id="dup", amount=Decimal("1"))
        before = {o.pk: snapshot(o) for o in (oracle, single, batch)}
    signals.seen.clear()
    said = direct(oracle, case.name, fill(case.payload, oracle.business_key))
    with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL=label):
        outcomes = {
            "single": consumed(single, case, batch=False),
            "batch": consumed(batch, case, batch=True),
        }
    expected = snapshot(oracle)
    for path, order in (("single", single), ("batch", batch)):
        assert outcomes[path] in EXPECTED[said], (path, said, outcomes[path])
        got = snapshot(order)
        if case.id == "database-refuses":
            # The oracle's row was the one refused; the others raised on it too.
            assert got == before[order.pk], path
        else:
            assert got == expected, path
        assert signals.seen.get(order.pk, []) == signals.seen.get(oracle.pk, []), path
        rows = ProcessedMessage.objects.filter(consumer=CONSUMER, order_id=order.pk)
        if said == RAISED:
            (row,) = rows
            assert row.status == InboxStatus.FAILED
            assert row.message_type == f"diff.{case.name}"
            assert json.loads(row.body)["payload"] == fill(case.payload, order.business_key)
            assert "Error(" in row.error
            assert " at " in row.error
        else:
            assert rows.count() == 1


def test_state_values_keep_their_type() -> None:
    from idempotent_orders.consuming.graph import edge

    assert edge(IntOrder, "approve").sources == {Level.SUBMITTED}
    assert type(next(iter(edge(IntOrder, "approve").sources))) is Level
    assert edge(KeyOrder, "kship").target == "shipped"
    cancel = edge(FlowOrder, "cancel")
    assert cancel.any_other
    assert "cancelled" not in cancel.sources
    remark = edge(FlowOrder, "remark")
    assert remark.targetless
    assert remark.any_source
    pay = edge(FlowOrder, "pay")
    assert pay.dynamic
    assert pay.target is None
    assert pay.targets == {"part_paid", "paid"}


# -- A shop's stream: partial payments and a shipment, shuffled and duplicated ----------


def _stream(order: Any, parts: list[str], ship: bool) -> list[dict[str, Any]]:
    tag = order.business_key
    messages = [
        {
            "message_id": f"{tag}-pay-{i}",
            "type": "diff.pay",
            "order_id": order.pk,
            "payload": {"payment_id": f"{tag}-{i}", "amount": amount},
        }
        for i, amount in enumerate(parts)
    ]
    if ship:
        messages.append(
            {
                "message_id": f"{tag}-ship",
                "type": "diff.ship",
                "order_id": order.pk,
                "payload": {"tracking_number": f"T-{tag}"},
            }
        )
    return messages


def _canonical(order: Any, parts: list[str], ship: bool) -> None:
    tag = order.business_key
    for i, amount in enumerate(parts):
        order = FlowOrder.objects.get(pk=order.pk)
        order.pay(payment_id=f"{tag}-{i}", amount=amount)
        order.save()
    if ship:
        order = FlowOrder.objects.get(pk=order.pk)
        order.ship(tracking_number=f"T-{tag}")
        order.save()


def _deliver(messages: list[dict[str, Any]], seed: int, copies: int, chunk: int) -> None:
    rng = random.Random(seed)
    storm = [m for m in messages for _ in range(copies)]
    rng.shuffle(storm)
    with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="shop.FlowOrder"):
        if chunk == 1:
            for message in storm:
                consume_message(message, consumer=CONSUMER)
        else:
            for start in range(0, len(storm), chunk):
                consume_batch(storm[start : start + chunk], consumer=CONSUMER)


@pytest.mark.django_db(transaction=True)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    parts=st.lists(
        st.sampled_from(["1.00", "2.50", "4.00", "6.00", "10.00"]), min_size=1, max_size=4
    ),
    ship=st.booleans(),
    seed=st.integers(0, 10_000),
    copies=st.integers(1, 3),
    chunk=st.sampled_from([1, 2, 5]),
)
def test_shuffled_duplicated_stream_ends_as_the_direct_calls(
    message_types: None, parts: list[str], ship: bool, seed: int, copies: int, chunk: int
) -> None:
    # Payments that leave the order short of its amount whatever their order, then
    # at most one that completes it: every arrival order is one the direct calls
    # accept (a payment after the order is paid is refused, whoever calls it).
    total, accepted = Decimal(0), []
    for amount in parts:
        if total >= Decimal("10.00"):
            break
        if accepted and total + Decimal(amount) - min(map(Decimal, [*accepted, amount])) >= 10:
            continue
        accepted.append(amount)
        total += Decimal(amount)
    ship = ship and total >= Decimal("10.00")
    case = Case("stream", FlowOrder, "pay")
    oracle, consumer_side = new_order(case), new_order(case)
    _canonical(oracle, accepted, ship)
    # Payments beyond full payment never apply (the order is paid); leave them out.
    _deliver(_stream(consumer_side, accepted, ship), seed, copies, chunk)
    # Each side's own tag reads "%" in the snapshots: the rows compare as they are.
    assert snapshot(consumer_side) == snapshot(oracle)
    applied = ProcessedMessage.objects.filter(
        consumer=CONSUMER, order_id=consumer_side.pk, outcome=Outcome.APPLIED
    ).count()
    assert applied == len(accepted) + int(ship)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["single", "batch"])
def test_a_payment_sent_again_to_a_partly_paid_order_is_a_duplicate(path: str) -> None:
    """The self-loop applies a second payment, never the same payment twice."""
    saved = dict(registry._registry)
    registry.register("diff.money", transition="pay", money=True)
    try:
        order = new_order(Case("partial", FlowOrder, "pay"))
        charge = f"ch-{order.business_key}"
        first, again = (
            {
                "message_id": f"m-{uuid.uuid4().hex}",
                "type": "diff.money",
                "order_id": order.pk,
                "payload": {"payment_id": charge, "amount": "4.00"},
            }
            for _ in range(2)
        )
        with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="shop.FlowOrder"):
            for message, expected in ((first, Outcome.APPLIED), (again, Outcome.DUPLICATE)):
                if path == "batch":
                    assert consume_batch([message], consumer=CONSUMER) == [expected]
                else:
                    assert consume_message(message, consumer=CONSUMER) is expected
    finally:
        registry._registry.clear()
        registry._registry.update(saved)
    fresh = FlowOrder.objects.get(pk=order.pk)
    assert (fresh.flow, fresh.paid_total) == ("part_paid", Decimal("4.00"))
    assert Payment.objects.filter(order_id=order.pk).count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.backends("postgresql", "mysql")
def test_racing_partial_payments_lose_no_update(message_types: None) -> None:
    """Threads deliver partial payments (and copies) of one order at once: every body
    reads the total another body may just have written, so only the conditional
    UPDATE on ``version`` keeps each payment in the total, once.
    """
    from tests.support.threads import run_threads

    order = new_order(Case("race", FlowOrder, "pay", amount="100.00"))
    tag = order.business_key
    payments = [
        {
            "message_id": f"{tag}-pay-{i}",
            "type": "diff.pay",
            "order_id": order.pk,
            "payload": {"payment_id": f"{tag}-{i}", "amount": "1.00"},
        }
        for i in range(24)
    ]
    deliveries = [(CONSUMER, m) for m in payments for _ in range(2)]
    random.Random(7).shuffle(deliveries)
    with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="shop.FlowOrder"):
        outcomes = run_threads(deliveries, 4)
    assert outcomes[Outcome.APPLIED.value] == 24
    fresh = FlowOrder.objects.get(pk=order.pk)
    assert (fresh.flow, fresh.paid_total) == ("part_paid", Decimal("24.00"))
    assert fresh.version == 24
    assert Payment.objects.filter(order_id=order.pk).count() == 24


@pytest.mark.django_db(transaction=True)
def test_a_receiver_that_saves_the_order_under_a_sequenced_message(
    message_types: None, signals: Signals
) -> None:
    """The receiver's save() wrote last_seq and the state already, in this transaction."""
    order = new_order(Case("saves", ConcurrentFlowOrder, "pay"))
    message = {
        "message_id": f"m-{uuid.uuid4().hex}",
        "type": "diff.pay",
        "order_id": order.pk,
        "seq": 1,
        "payload": {"payment_id": f"p-{order.business_key}", "amount": "10.00"},
    }
    with override_settings(IDEMPOTENT_ORDERS_ORDER_MODEL="shop.ConcurrentFlowOrder"):
        assert consume_message(message, consumer=CONSUMER) is Outcome.APPLIED
    fresh = ConcurrentFlowOrder.objects.get(pk=order.pk)
    assert (fresh.flow, fresh.last_seq, fresh.version) == ("paid", 1, 1)
    assert fresh.note == "receipt for paid"
