"""Property-based: any mix of duplicates, reorderings and crashes keeps effects exactly once."""

from __future__ import annotations

import contextlib
import random
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from idempotent_orders import services
from idempotent_orders.models import InboxStatus, OrderStatus, Outcome, ProcessedMessage
from idempotent_orders.services import consume_message
from idempotent_orders.tasks import fulfilment_message
from tests.chaos import Planned, check_invariants, lifecycle, make_orders


class Crash(Exception):
    """A worker dying at a chosen point: the broker will deliver the message again."""


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise Crash


def _after(real: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise Crash

    return wrapper


def _during_release(real: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("parked") is not None:
            raise Crash
        return real(*args, **kwargs)

    return wrapper


#: Where a worker may die, as patches of the consumer's steps. Add a point here when
#: a new phase appears (leased work: after claiming, after the outside call, ...).
CRASH_POINTS: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    # Inside the transaction, after the conditional UPDATE: everything rolls back.
    "after_update": lambda: mock.patch.object(
        services, "apply_transition", _after(services.apply_transition)
    ),
    # Committed, but the fast-path mark (an on_commit hook) never happens.
    "after_commit": lambda: mock.patch.object(services.dedup, "remember", _raise),
    # Committed, but the parked successors are never released by this delivery.
    "before_release": lambda: mock.patch.object(services, "release_parked", _raise),
    # While releasing a parked successor, before its transaction commits.
    "during_release": lambda: mock.patch.object(
        services, "_consume", _during_release(services._consume)
    ),
}


class Consumer(RuleBasedStateMachine):
    """Two orders' messages, delivered in any order, any number of times, crashing anywhere."""

    def __init__(self) -> None:
        super().__init__()
        rng = random.Random(0)
        run = uuid.uuid4().hex[:8]
        self.orders = make_orders(2, prefix="prop")
        self.planned: list[Planned] = []
        for n, order in enumerate(self.orders):
            self.planned += lifecycle(order, run=run, with_seq=n == 0)
            # A second notice of the same payment under a new id: either one applies, never
            # both (check_invariants: no transition twice, version = applied rows).
            first = self.planned.pop(-3)
            again = dict(first.message, message_id=f"{run}-{order.pk}-again")
            self.planned += [Planned("payments", m, expect=None) for m in (first.message, again)]
            self.planned.append(Planned("fulfilment", fulfilment_message(order.pk), expect=None))
        rng.shuffle(self.planned)
        self.crashes = 0

    def _pick(self, index: int) -> Planned:
        return self.planned[index % len(self.planned)]

    @rule(index=st.integers(0, 63))
    def deliver(self, index: int) -> None:
        p = self._pick(index)
        outcome = consume_message(p.message, consumer=p.consumer)
        assert outcome in set(Outcome)

    @rule(index=st.integers(0, 63), point=st.sampled_from(sorted(CRASH_POINTS)))
    def crash(self, index: int, point: str) -> None:
        p = self._pick(index)
        with contextlib.suppress(Crash), CRASH_POINTS[point]():
            consume_message(p.message, consumer=p.consumer)
            return  # the crash point was not on this message's path
        self.crashes += 1

    @invariant()
    def effects_never_doubled(self) -> None:
        report = check_invariants([], {o.pk: None for o in self.orders})
        # Mid-run, parked rows are allowed; doubled effects and version drift never are.
        bad = [v for v in report.violations if "parked" not in v]
        assert not bad, bad
        assert not ProcessedMessage.objects.filter(
            order__in=self.orders, status=InboxStatus.PROCESSING
        ).exists()

    def teardown(self) -> None:
        # At-least-once delivery: the broker eventually hands every message over again.
        for p in self.planned:
            consume_message(p.message, consumer=p.consumer)
        report = check_invariants(self.planned, {o.pk: OrderStatus.COMPLETED for o in self.orders})
        assert not report.violations, report.violations


def test_consumer_state_machine(transactional_db: None) -> None:
    run_state_machine_as_test(Consumer)


@pytest.fixture
def _no_crash_points_leak() -> Iterator[None]:
    yield
    assert services.release_parked.__name__ == "release_parked"


@pytest.mark.usefixtures("_no_crash_points_leak")
def test_crash_points_are_restored(transactional_db: None) -> None:
    orders = make_orders(1, prefix="prop")
    pay = lifecycle(orders[0], run="restore", with_seq=False)[0]
    with contextlib.suppress(Crash), CRASH_POINTS["after_update"]():
        consume_message(pay.message, consumer=pay.consumer)
    assert not ProcessedMessage.objects.filter(message_id=pay.key[1]).exists()  # rolled back
    assert consume_message(pay.message, consumer=pay.consumer) == Outcome.APPLIED
