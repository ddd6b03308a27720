"""The testing kit adopters use (``idempotent_orders.testing``) does what it says: its
storms deliver every copy, its crash points kill a delivery before commit, and its
invariant fails when a message was lost, failed or applied twice."""

from __future__ import annotations

import collections
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.apps import apps
from django.core import mail
from django.core.mail import send_mail
from django.db import connection, transaction
from django_fsm import transition
from django_fsm.signals import post_transition

from idempotent_orders.consuming.single import consume_message
from idempotent_orders.effects import effect
from idempotent_orders.models import Order, OrderStatus, Outcome, ProcessedMessage, SpentPayment
from idempotent_orders.testing import (
    Effect,
    EffectBeforeCommit,
    WorkerDied,
    assert_exactly_once,
    crash_at,
    deliver,
    shuffled_copies,
    watch_effects,
)
from idempotent_orders.testing.kit import ExactlyOnce, _without_commit
from tests.support.gateway import capture, captured
from tests.support.messages import payment, shipment


def lifecycle(order: Any) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("payments", payment(order, seq=1)),
        ("shipping", shipment(order, seq=2)),
        ("shipping", shipment(order, "delivered", seq=3)),
    ]


def completed(orders: list[Any]) -> dict[Any, str]:
    return {o.pk: OrderStatus.COMPLETED for o in orders}


def test_shuffled_copies_are_reproducible_and_keep_every_message() -> None:
    messages = [("payments", {"message_id": str(i)}) for i in range(20)]
    storm = shuffled_copies(messages, copies=(1, 4), seed=5)
    assert storm == shuffled_copies(messages, copies=(1, 4), seed=5)
    counts = Counter(m["message_id"] for _, m in storm)
    assert set(counts) == {str(i) for i in range(20)}
    assert set(counts.values()) <= {1, 2, 3, 4}
    assert len(set(counts.values())) > 1
    assert Counter(m["message_id"] for _, m in shuffled_copies(messages, copies=3)) == {
        str(i): 3 for i in range(20)
    }


@pytest.mark.django_db
def test_the_fixture_delivers_a_storm_one_by_one_and_in_batches(
    exactly_once: ExactlyOnce, make_order: Any
) -> None:
    assert isinstance(exactly_once, ExactlyOnce)
    single, batched = [make_order() for _ in range(3)], [make_order() for _ in range(3)]
    for orders, run in ((single, exactly_once.deliver), (batched, exactly_once.deliver_in_batches)):
        messages = [m for o in orders for m in lifecycle(o)]
        storm = exactly_once.shuffled_copies(messages)
        outcomes = run(storm)
        assert sum(outcomes.values()) == len(storm)
        exactly_once.assert_exactly_once(orders, messages, states=completed(orders))


@pytest.mark.django_db(transaction=True)
@pytest.mark.backends("postgresql", "mysql")
def test_the_fixture_delivers_a_storm_from_threads_and_an_event_loop(
    exactly_once: ExactlyOnce, make_order: Any
) -> None:
    for run in (exactly_once.deliver_from_threads, exactly_once.deliver_from_event_loop):
        orders = [make_order() for _ in range(4)]
        messages = [m for o in orders for m in lifecycle(o)]
        storm = exactly_once.shuffled_copies(messages, copies=(2, 4))
        assert sum(run(storm).values()) == len(storm)
        exactly_once.assert_exactly_once(orders, messages, states=completed(orders))


@pytest.mark.parametrize("transactional", [False, True], ids=["in-test-transaction", "commits"])
@pytest.mark.parametrize("point", ["after_inbox_insert", "after_order_update"])
def test_a_crash_writes_nothing_and_the_redelivery_applies_once(
    request: pytest.FixtureRequest, point: str, transactional: bool
) -> None:
    request.getfixturevalue("transactional_db" if transactional else "db")
    make_order = request.getfixturevalue("make_order")
    order = make_order()
    message = payment(order)
    with pytest.raises(WorkerDied, match=point.split("_")[-1]), crash_at(point) as crash:
        consume_message(message, consumer="payments")
    assert crash.fired == 1
    assert not ProcessedMessage.objects.filter(message_id=message["message_id"]).exists()
    assert type(order)._default_manager.get(pk=order.pk).version == 0
    assert connection.is_usable()
    # The broker redelivers: applied once, then a duplicate.
    assert deliver([("payments", message)] * 2) == {Outcome.APPLIED: 1, Outcome.DUPLICATE: 1}
    assert_exactly_once([order], [("payments", message)], states={order.pk: OrderStatus.PAID})


@pytest.mark.django_db
def test_a_crash_point_fires_the_given_number_of_times(make_order: Any) -> None:
    orders = [make_order() for _ in range(3)]
    messages = [("payments", payment(o)) for o in orders]
    died = 0
    with crash_at("after_order_update", times=2) as crash:
        for delivery in messages * 2:
            try:
                deliver([delivery])
            except WorkerDied:
                died += 1
    assert (died, crash.fired) == (2, 2)
    assert_exactly_once(orders, messages)


@pytest.mark.django_db
def test_a_crash_point_never_reached_or_unknown_fails_the_test(make_order: Any) -> None:
    with pytest.raises(ValueError, match="unknown crash point"), crash_at("before_lunch"):
        pass
    with pytest.raises(AssertionError, match="never reached"), crash_at("after_order_update"):
        pass


@pytest.mark.django_db
def test_the_invariant_fails_on_a_lost_a_failed_or_a_doubled_message(make_order: Any) -> None:
    order = make_order()
    pay, ship = payment(order, seq=1), shipment(order, seq=2)
    deliver([("payments", pay)])
    with pytest.raises(AssertionError, match="no inbox row"):
        assert_exactly_once([order], [("payments", pay), ("shipping", ship)])
    with pytest.raises(AssertionError, match="in 'paid', expected 'shipped'"):
        assert_exactly_once([order], [("payments", pay)], states={order.pk: "shipped"})
    ProcessedMessage.objects.filter(message_id=pay["message_id"]).update(status="failed")
    with pytest.raises(AssertionError, match="left failed"):
        assert_exactly_once([order], [("payments", pay)])
    ProcessedMessage.objects.filter(message_id=pay["message_id"]).update(status="done")
    type(order)._default_manager.filter(pk=order.pk).update(version=2)
    with pytest.raises(AssertionError, match=r"version 2, but 0 \+ 1 applied"):
        assert_exactly_once([order], [("payments", pay)])
    assert_exactly_once([order], [("payments", pay)], baseline={order.pk: 1})


def test_the_fixture_is_not_autouse(request: pytest.FixtureRequest) -> None:
    assert "exactly_once" not in request.fixturenames
    assert "db" not in request.fixturenames


# --- crash points in transactional tests, on every road ---------------------------------------


@pytest.fixture
def receiver() -> Iterator[list[Any]]:
    """A ``post_transition`` receiver on every order: the project's code runs, so the
    message takes the road that runs it (PostgreSQL: two texts, the second ending in
    ``COMMIT``)."""
    heard: list[Any] = []

    def receive(sender: Any, instance: Any, name: str, **kwargs: Any) -> None:
        heard.append((instance.pk, name))

    post_transition.connect(receive, weak=False, dispatch_uid="test-kit-receiver")
    yield heard
    post_transition.disconnect(dispatch_uid="test-kit-receiver")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("point", ["after_inbox_insert", "after_order_update"])
def test_a_crash_where_the_projects_code_runs_writes_nothing(
    point: str, make_order: Any, receiver: list[Any]
) -> None:
    consume_message(payment(make_order()), consumer="payments")  # the texts compiled
    order = make_order()
    message = payment(order)
    with pytest.raises(WorkerDied), crash_at(point) as crash:
        consume_message(message, consumer="payments")
    assert crash.fired == 1
    assert not ProcessedMessage.objects.filter(message_id=message["message_id"]).exists()
    assert not SpentPayment.objects.filter(order_id=order.pk).exists()
    assert type(order)._default_manager.get(pk=order.pk).version == 0
    assert deliver([("payments", message)] * 2) == {Outcome.APPLIED: 1, Outcome.DUPLICATE: 1}
    assert_exactly_once([order], [("payments", message)], states={order.pk: OrderStatus.PAID})


def test_a_text_that_commits_runs_without_its_commit_or_not_at_all() -> None:
    assert _without_commit("WITH moved AS (UPDATE t SET v = 1) SELECT 1; COMMIT") == (
        "WITH moved AS (UPDATE t SET v = 1) SELECT 1",
        True,
    )
    assert _without_commit("UPDATE t SET v = 1") == ("UPDATE t SET v = 1", False)
    assert _without_commit("UPDATE t SET v = 1; commit ; ") == ("UPDATE t SET v = 1", True)
    text = "START TRANSACTION; UPDATE t SET v = 1; COMMIT; SELECT 1"
    assert _without_commit(text) == (text, None)


def test_the_fixture_asks_for_a_transactional_database_by_default(
    exactly_once: ExactlyOnce, request: pytest.FixtureRequest
) -> None:
    assert "transactional_db" in request.fixturenames
    assert "db" not in request.fixturenames


# --- effects outside the database -------------------------------------------------------------

GATEWAY = "tests.support.gateway.capture"


def send_receipt(order: Any) -> None:
    send_mail(f"Order {order.pk} paid", "Thank you.", "shop@example.com", ["ana@example.com"])


@pytest.fixture
def order_model_with(settings: Any) -> Iterator[Callable[[Callable[..., None]], type[Any]]]:
    """Makes the order model a proxy of ``Order`` whose ``pay`` runs ``body(order,
    payment_id, amount)``: a project's transition with a body."""
    made: list[str] = []

    def use(body: Callable[..., None]) -> type[Any]:
        name = f"BodyOrder{len(made)}"

        def pay(self: Any, payment_id: str, amount: str) -> None:
            body(self, payment_id, amount)

        attrs = {
            "__module__": __name__,
            "Meta": type("Meta", (), {"proxy": True, "app_label": "idempotent_orders"}),
            "pay": transition(
                field="status", source=OrderStatus.PENDING_PAYMENT, target=OrderStatus.PAID
            )(pay),
        }
        model = type(name, (Order,), attrs)
        made.append(name.lower())
        settings.IDEMPOTENT_ORDERS_ORDER_MODEL = f"idempotent_orders.{name}"
        return model

    captured.clear()
    yield use
    captured.clear()
    for name in made:
        del apps.all_models["idempotent_orders"][name]
    apps.clear_cache()


def storm_after_a_crash(
    exactly_once: ExactlyOnce, orders: list[Any]
) -> list[tuple[str, dict[str, Any]]]:
    """The docs' test: one delivery dies before its commit, then a shuffled storm of
    every message, one by one and in batches; the invariant checked."""
    messages = [("payments", payment(o)) for o in orders]
    with pytest.raises(WorkerDied), exactly_once.crash_at("after_order_update"):
        exactly_once.deliver(messages[:1])
    storm = exactly_once.shuffled_copies(messages, copies=(1, 4))
    exactly_once.deliver(storm[::2])
    exactly_once.deliver_in_batches(storm[1::2])
    exactly_once.assert_exactly_once(orders, messages)
    return messages


@pytest.mark.django_db(transaction=True)
def test_an_email_sent_from_post_transition_is_caught(
    exactly_once: ExactlyOnce, make_order: Any
) -> None:
    def on_paid(sender: Any, instance: Any, name: str, **kwargs: Any) -> None:
        if name == "pay":
            send_receipt(instance)  # the planted bug: before commit

    post_transition.connect(on_paid, weak=False, dispatch_uid="test-kit-mail")
    try:
        orders = [make_order() for _ in range(3)]
        with (
            pytest.raises(AssertionError) as failed,
            exactly_once.watch_effects("mail", before_commit="ignore") as seen,
        ):
            storm_after_a_crash(exactly_once, orders)
    finally:
        post_transition.disconnect(dispatch_uid="test-kit-mail")
    first = orders[0]
    report = str(failed.value)
    assert f"mail 'Order {first.pk} paid' to ana@example.com ran 2 times" in report
    assert re.search(
        rf"1\. message payments/pay-msg-{first.pk}-\d+, inside a transition, before commit,"
        r" at tests/project/test_testing_kit\.py:\d+ in send_receipt; then the worker died at"
        r" after_order_update",
        report,
    )
    assert re.search(r"2\. message payments/pay-msg-\d+-\d+, inside a transition", report)
    assert "Where an effect belongs" in report
    assert len(mail.outbox) == 4
    assert seen.count("mail")[(f"Order {orders[1].pk} paid",)] == 0
    assert sorted(seen.count("mail").values()) == [1, 1, 2]


def captures_in_the_body(order: Any, payment_id: str, amount: str) -> None:
    capture(payment_id, amount)  # the planted bug: before commit


@pytest.mark.django_db(transaction=True)
def test_a_gateway_called_in_a_transition_body_is_caught(
    exactly_once: ExactlyOnce, make_order: Any, order_model_with: Any
) -> None:
    order_model_with(captures_in_the_body)
    orders = [make_order() for _ in range(3)]
    with pytest.raises(AssertionError) as failed, exactly_once.watch_effects(GATEWAY):
        storm_after_a_crash(exactly_once, orders)
    report = str(failed.value)
    assert f"{GATEWAY} ('pay-{orders[0].pk}', '12.50') ran 2 times" in report
    assert re.search(
        r"1\. message payments/pay-msg-\d+-\d+, inside a transition, before commit, at"
        r" tests/project/test_testing_kit\.py:\d+ in captures_in_the_body; then the worker died at"
        r" after_order_update",
        report,
    )
    assert sorted(collections.Counter(captured).values()) == [1, 1, 2]


@pytest.mark.django_db(transaction=True)
def test_an_effect_before_commit_warns_or_fails_on_its_own(
    exactly_once: ExactlyOnce, make_order: Any, order_model_with: Any
) -> None:
    order_model_with(captures_in_the_body)
    first, second = make_order(), make_order()
    with (
        pytest.warns(EffectBeforeCommit, match=r"in captures_in_the_body: .*docs/testing\.md"),
        exactly_once.watch_effects(GATEWAY),
    ):
        exactly_once.deliver([("payments", payment(first))])
    with (
        pytest.raises(AssertionError, match=r"called before commit .*in captures_in_the_body"),
        exactly_once.watch_effects(GATEWAY, before_commit="fail"),
    ):
        exactly_once.deliver([("payments", payment(second))])
    assert captured == [(f"pay-{first.pk}", "12.50"), (f"pay-{second.pk}", "12.50")]


@pytest.mark.django_db(transaction=True)
def test_a_shop_with_its_effects_after_commit_passes(
    exactly_once: ExactlyOnce, make_order: Any, order_model_with: Any
) -> None:
    def pay(order: Any, payment_id: str, amount: str) -> None:
        transaction.on_commit(lambda: capture(payment_id, amount))

        def marked() -> None:
            with effect("loyalty.award", order=order.pk):
                pass

        transaction.on_commit(marked)

    def on_paid(sender: Any, instance: Any, name: str, **kwargs: Any) -> None:
        if name == "pay":
            transaction.on_commit(lambda: send_receipt(instance))

    order_model_with(pay)
    post_transition.connect(on_paid, weak=False, dispatch_uid="test-kit-mail")
    try:
        orders = [make_order() for _ in range(4)]
        with (
            warnings.catch_warnings(),
            exactly_once.watch_effects(GATEWAY, "mail") as seen,
        ):
            warnings.simplefilter("error", EffectBeforeCommit)
            storm_after_a_crash(exactly_once, orders)
    finally:
        post_transition.disconnect(dispatch_uid="test-kit-mail")
    assert sorted(captured) == sorted((f"pay-{o.pk}", "12.50") for o in orders)
    assert len(mail.outbox) == 4
    assert sum(seen.count("loyalty.award").values()) == 4
    assert not any(call.before_commit for call in seen.calls)
    assert all(call.died_at is None for call in seen.calls)


@pytest.mark.django_db(transaction=True)
@pytest.mark.backends("postgresql", "mysql")
def test_effects_are_counted_across_threads_and_an_event_loop(
    exactly_once: ExactlyOnce, make_order: Any, order_model_with: Any
) -> None:
    order_model_with(
        lambda order, payment_id, amount: transaction.on_commit(lambda: capture(payment_id, amount))
    )
    for run in (exactly_once.deliver_from_threads, exactly_once.deliver_from_event_loop):
        captured.clear()
        orders = [make_order() for _ in range(4)]
        messages = [("payments", payment(o)) for o in orders]
        with exactly_once.watch_effects(GATEWAY) as seen:
            run(exactly_once.shuffled_copies(messages, copies=(2, 4)))
            exactly_once.assert_exactly_once(orders, messages)
        assert sorted(seen.count(GATEWAY).values()) == [1, 1, 1, 1]
        assert {call.message for call in seen.calls} == {
            f"payments/{m['message_id']}" for _, m in messages
        }


def capture_twice() -> None:
    capture("p", "1")  # this module imported it by name
    capture("p", "1")


def test_an_effect_declared_by_dotted_path_is_counted_where_it_was_imported() -> None:
    captured.clear()
    with (
        pytest.raises(AssertionError, match=rf"{GATEWAY} \('p', '1'\) ran 2 times"),
        watch_effects(GATEWAY) as seen,
    ):
        capture_twice()
    assert capture.__module__ == "tests.support.gateway"
    assert [c.where.split(":")[0] for c in seen.calls] == ["tests/project/test_testing_kit.py"] * 2
    assert captured == [("p", "1")] * 2
    captured.clear()
    with pytest.raises(ValueError, match="cannot find the effect"), watch_effects("no.such.thing"):
        pass


@pytest.mark.django_db
def test_before_commit_is_told_from_the_transactions_the_code_opens_not_the_tests() -> None:
    by_payment = Effect(GATEWAY, name="capture", key=lambda call: call.args[0])
    with watch_effects(by_payment, before_commit="ignore") as seen:
        capture("p-1", "1")
        with transaction.atomic():
            capture("p-2", "2")
        capture("p-3", "3")
    assert [c.before_commit for c in seen.calls] == [False, True, False]
    assert seen.count("capture") == {"p-1": 1, "p-2": 1, "p-3": 1}
    with (
        pytest.raises(AssertionError, match=r"capture \('p-1', '1'\) ran 2 times"),
        watch_effects(by_payment, before_commit="ignore"),
    ):
        capture_one_payment_twice()
    captured.clear()


def capture_one_payment_twice() -> None:
    capture("p-1", "1")
    capture("p-1", "9")  # another amount, the same payment: the key says so
