"""Durable timers: written with the order's state, fired once through the inbox, racing payments."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from idempotent_orders import get_order_model, timers
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import (
    Outcome,
    ParkedMessage,
    ProcessedMessage,
    Timer,
    TimerStatus,
)
from idempotent_orders.timers import CONSUMER, fire, fire_due, schedule

PAST = timedelta(seconds=1)


def timeout(seconds: int) -> Any:
    return override_settings(
        IDEMPOTENT_ORDERS={**settings.IDEMPOTENT_ORDERS, "PAYMENT_TIMEOUT": seconds}
    )


def payment(order: Any, payment_id: str = "pi_late") -> dict[str, Any]:
    return {
        "message_id": f"pay-{order.pk}-{payment_id}",
        "type": "payment.succeeded",
        "order_id": order.pk,
        "payload": {"payment_id": payment_id, "amount": "12.50", "currency": "CNY"},
    }


@pytest.mark.django_db
def test_a_new_order_gets_its_expiry_timer_in_its_own_transaction(
    make_order: Callable[..., Any],
) -> None:
    with timeout(900):
        with transaction.atomic():
            order = make_order()
        (timer,) = Timer.objects.filter(order=order)
        assert timer.transition == "expire"
        assert timer.message_id == f"timer:idempotent_orders.order:{order.pk}:expire:payment"
        assert abs((timer.due_at - timezone.now()).total_seconds() - 900) < 60

        # Rolled back with the order: no timer without its state.
        def create_then_fail() -> None:
            with transaction.atomic():
                make_order()
                raise RuntimeError

        with pytest.raises(RuntimeError):
            create_then_fail()
        assert Timer.objects.count() == 1
    make_order()  # PAYMENT_TIMEOUT = 0: no timer
    assert Timer.objects.count() == 1


@pytest.mark.django_db
def test_a_due_timer_expires_the_order_once_however_often_it_fires(
    make_order: Callable[..., Any],
) -> None:
    order = make_order()
    with transaction.atomic():
        timer = schedule(order, "expire", at=timezone.now() - PAST)
        assert schedule(order, "expire", at=timezone.now()) == timer  # the same timer
    assert [(t.pk, o) for t, o in fire_due()] == [(timer.pk, Outcome.APPLIED)]
    order.refresh_from_db()
    assert (order.status, order.version) == ("expired", 1)
    # A second beat that read the timer before it was marked: the inbox answers.
    Timer.objects.filter(pk=timer.pk).update(status=TimerStatus.PENDING, outcome="")
    assert fire(timer) is Outcome.APPLIED  # what the first firing decided; nothing ran
    assert fire_due() == []
    order.refresh_from_db()
    assert order.version == 1
    assert ProcessedMessage.objects.filter(consumer=CONSUMER).count() == 1
    timer.refresh_from_db()
    assert (timer.status, timer.outcome) == (TimerStatus.FIRED, Outcome.APPLIED)


@pytest.mark.django_db
def test_the_same_timer_consumed_twice_is_a_duplicate(make_order: Callable[..., Any]) -> None:
    order = make_order()
    timer = schedule(order, "expire", at=timezone.now() - PAST)
    message = {
        "message_id": timer.message_id,
        "type": timer.message_type,
        "order_id": order.pk,
        "payload": {},
    }
    assert consume_message(message, consumer=CONSUMER) is Outcome.APPLIED
    # Another process that saw the order still waiting consumes the same message id.
    assert consume_message(message, consumer=CONSUMER) is Outcome.DUPLICATE
    order.refresh_from_db()
    assert order.version == 1


@pytest.mark.django_db
def test_a_paid_order_is_not_expired_and_its_timer_sends_nothing(
    make_order: Callable[..., Any],
) -> None:
    order = make_order()
    timer = schedule(order, "expire", at=timezone.now() - PAST)
    assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    assert [o for _, o in fire_due()] == [Outcome.STALE]
    order.refresh_from_db()
    assert order.status == "paid"
    assert not ProcessedMessage.objects.filter(consumer=CONSUMER).exists()
    timer.refresh_from_db()
    assert "no longer applies" in timer.error


@pytest.mark.django_db
def test_a_payment_after_expiry_is_money_to_give_back(make_order: Callable[..., Any]) -> None:
    order = make_order()
    schedule(order, "expire", at=timezone.now() - PAST)
    fire_due()
    assert consume_message(payment(order), consumer="payments") is Outcome.REJECTED
    row = ProcessedMessage.objects.get(consumer="payments")
    assert "money to give back" in row.error


@pytest.mark.django_db
def test_schedule_refuses_what_could_never_fire_at_call_time(
    make_order: Callable[..., Any],
) -> None:
    order = make_order()
    with pytest.raises(ValueError, match="declares no transition 'evaporate'"):
        schedule(order, "evaporate", at=timezone.now())
    naive = timezone.make_naive(timezone.now() + timedelta(minutes=5))
    with pytest.raises(ValueError, match="is naive"):
        schedule(order, "expire", at=naive)
    with pytest.raises(TypeError, match="must be a datetime"):
        schedule(order, "expire", at=900)  # type: ignore[arg-type]
    assert not Timer.objects.exists()
    # A past time is accepted: the timer is due, the next pass fires it.
    timer = schedule(order, "expire", at=timezone.now() - timedelta(days=1))
    assert [(t.pk, o) for t, o in fire_due()] == [(timer.pk, Outcome.APPLIED)]


@pytest.mark.django_db
def test_a_payment_that_wins_between_the_check_and_the_consume_leaves_the_timer_stale(
    make_order: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    order = make_order()
    timer = schedule(order, "expire", at=timezone.now() - PAST)
    checked = timers._still_possible

    def payment_commits_right_after_the_check(t: Timer) -> str:
        moved_on = checked(t)
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
        monkeypatch.setattr(timers, "_still_possible", checked)
        return moved_on

    monkeypatch.setattr(timers, "_still_possible", payment_commits_right_after_the_check)
    assert [o for _, o in fire_due()] == [Outcome.STALE]
    timer.refresh_from_db()
    assert (timer.status, timer.outcome) == (TimerStatus.FIRED, Outcome.STALE)
    assert timer.error == "order is paid; expire no longer applies"
    # Fired again by a beat that read it pending: the same record, the same reason.
    Timer.objects.filter(pk=timer.pk).update(status=TimerStatus.PENDING, outcome="", error="")
    assert fire(timer) is Outcome.STALE
    timer.refresh_from_db()
    assert (timer.outcome, timer.error) == (
        Outcome.STALE,
        "order is paid; expire no longer applies",
    )
    order.refresh_from_db()
    assert (order.status, order.version) == ("paid", 1)


@pytest.mark.django_db
def test_a_timer_ahead_of_its_source_state_parks_then_applies_when_the_order_gets_there(
    make_order: Callable[..., Any],
) -> None:
    order = make_order()  # pending_payment; "ship" starts from paid or processing
    timer = schedule(order, "ship", at=timezone.now() - PAST)
    assert [o for _, o in fire_due()] == [Outcome.PARKED]
    timer.refresh_from_db()
    assert (timer.status, timer.outcome) == (TimerStatus.FIRED, Outcome.PARKED)
    assert timer.error == "order is pending_payment; ship is not possible yet"
    assert ParkedMessage.objects.filter(message_id=timer.message_id).exists()
    # The payment puts the order in ship's source state: the parked timer applies then.
    assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    order.refresh_from_db()
    assert order.status == "shipped"


def _run_together(*work: Callable[[], Any]) -> list[Any]:
    """Run each callable in its own thread and database connection, released together."""
    barrier = threading.Barrier(len(work))
    results: list[Any] = [None] * len(work)

    def run(i: int, job: Callable[[], Any]) -> None:
        try:
            barrier.wait()
            results[i] = job()
        except BaseException as exc:  # reported by the test
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i, w)) for i, w in enumerate(work)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db(transaction=True)
def test_several_beats_fire_each_timer_once(make_order: Callable[..., Any]) -> None:
    orders = [make_order() for _ in range(20)]
    for order in orders:
        schedule(order, "expire", at=timezone.now() - PAST)
    # Four beats/workers at once; the claim is released at once so they really overlap.
    with override_settings(
        IDEMPOTENT_ORDERS={**settings.IDEMPOTENT_ORDERS, "TIMER_CLAIM_SECONDS": 0}
    ):
        results = _run_together(*[fire_due] * 4)
    assert not [r for r in results if isinstance(r, BaseException)]
    model = get_order_model()
    states = list(model._default_manager.values_list("status", "version"))
    assert states == [("expired", 1)] * 20
    applied = ProcessedMessage.objects.filter(consumer=CONSUMER, outcome=Outcome.APPLIED)
    assert applied.count() == 20
    assert set(Timer.objects.values_list("status", flat=True)) == {TimerStatus.FIRED}


@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db(transaction=True)
def test_a_late_payment_racing_the_expiry_ends_in_exactly_one_outcome(
    make_order: Callable[..., Any],
) -> None:
    model = get_order_model()
    seen: dict[str, int] = {"paid": 0, "expired": 0}
    for _ in range(15):
        order = make_order(amount=Decimal("12.50"))
        schedule(order, "expire", at=timezone.now() - PAST)
        paid, _fired = _run_together(
            lambda o=order: consume_message(payment(o), consumer="payments"),
            lambda: fire_due(),
        )
        assert not isinstance(paid, BaseException), paid
        order = model._default_manager.get(pk=order.pk)
        seen[order.status] += 1
        assert order.version == 1  # one transition, never two
        pay_row = ProcessedMessage.objects.get(consumer="payments", order_id=order.pk)
        timer_row = ProcessedMessage.objects.filter(consumer=CONSUMER, order_id=order.pk).first()
        if order.status == "paid":
            assert paid is Outcome.APPLIED
            assert pay_row.outcome == Outcome.APPLIED
            assert timer_row is None or timer_row.outcome != Outcome.APPLIED
            # However the race went, the timer says stale and why (never an empty reason).
            timer = Timer.objects.get(order=order)
            assert (timer.outcome, timer.error) == (
                Outcome.STALE,
                "order is paid; expire no longer applies",
            )
        else:
            assert order.status == "expired"
            assert paid is Outcome.REJECTED
            assert "money to give back" in pay_row.error
            assert timer_row is not None
            assert timer_row.outcome == Outcome.APPLIED
    print("race outcomes", seen)
    assert sum(seen.values()) == 15


@pytest.mark.django_db
def test_the_timer_admin_shows_why_a_timer_went_stale(
    make_order: Callable[..., Any], staff: Any
) -> None:
    order = make_order()
    schedule(order, "expire", at=timezone.now() - PAST)
    consume_message(payment(order), consumer="payments")
    fire_due()
    page = staff.get("/admin/idempotent_orders/timer/")
    assert page.status_code == 200
    assert b"order is paid; expire no longer applies" in page.content
