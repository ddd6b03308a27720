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
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from idempotent_orders.consuming import batch, single, writing
from idempotent_orders.consuming.backends import at_once
from idempotent_orders.consuming.backends.postgresql import one_statement
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.graph import TransitionStatus, classify
from idempotent_orders.consuming.registry import get_handler
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import (
    InboxStatus,
    Order,
    OrderStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.tasks import fulfilment_message
from tests.support.chaos import Planned, check_invariants, lifecycle, make_orders


class Crash(BaseException):
    """A worker dying at a chosen point: the broker will deliver the message again.

    Not an ``Exception``: a death records nothing (an exception from the project's
    code is kept as a failed message instead).
    """


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


def _after_applied(real: Callable[..., Any]) -> Callable[..., Any]:
    """Dies once the one statement committed; a message it left alone goes on."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if real(*args, **kwargs) is not None:
            raise Crash
        return None

    return wrapper


@contextlib.contextmanager
def _both(*patches: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


#: Where a worker may die, as patches of the consumer's steps. Add a point here when
#: a new phase appears (leased work: after claiming, after the outside call, ...).
CRASH_POINTS: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    # Inside the transaction of the road after the read, after the conditional UPDATE:
    # everything rolls back. (The roads without a read have no such moment: a death
    # before they commit.)
    "after_update": lambda: _both(
        mock.patch.object(writing, "commit", _after(writing.commit)),
        mock.patch.object(one_statement, "apply_unread", _raise),
        mock.patch.object(at_once, "apply_unread_at_once", _raise),
    ),
    # A road without a read (PostgreSQL's one statement, MariaDB's and SQLite's one
    # transaction) committed; nothing after it happened.
    "after_claim": lambda: _both(
        mock.patch.object(
            one_statement, "apply_unread", _after_applied(one_statement.apply_unread)
        ),
        mock.patch.object(
            at_once,
            "apply_unread_at_once",
            _after_applied(at_once.apply_unread_at_once),
        ),
    ),
    # Committed, but the fast-path mark (an on_commit hook) never happens.
    "after_commit": lambda: mock.patch.object(single.dedup, "remember", _raise),
    # Committed, but the parked successors are never released by this delivery.
    "before_release": lambda: mock.patch.object(single, "release_parked", _raise),
    # While releasing a parked successor, before its transaction commits.
    "during_release": lambda: mock.patch.object(
        single, "_consume", _during_release(single._consume)
    ),
}

#: Where a worker may die while consuming a batch (consume_batch).
BATCH_CRASH_POINTS: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    # Inside the chunk's transaction, after the orders were written: everything rolls back.
    "batch_before_commit": lambda: mock.patch.object(
        batch, "record_outcomes", _after(batch.record_outcomes)
    ),
    # Committed, but the fast-path marks (on_commit hooks, run at once) never happen.
    "batch_after_commit": lambda: mock.patch.object(batch.dedup, "remember_many", _raise),
    # Committed and marked, but the parked successors are never released by this delivery.
    "batch_before_release": lambda: mock.patch.object(batch, "release_parked", _raise),
}


def releasable_but_parked(orders: list[Order]) -> list[str]:
    """Parked messages of ``orders`` that their order no longer makes wait.

    Each would leave the park if released now: its ``seq`` is not beyond the next
    one, and its transition is possible, done or impossible (not merely later).
    Once every delivery a worker died in has been delivered again, there are none.
    """
    stuck = []
    for parked in ParkedMessage.objects.filter(order__in=orders).select_related("order"):
        order, seq = parked.order, parked.envelope.get("seq")
        if seq is not None and seq > order.last_seq + 1:
            continue
        handler = get_handler(parked.envelope["type"])
        assert handler is not None
        if classify(Order, handler.transition, order.status) is TransitionStatus.LATER:
            continue
        stuck.append(
            f"{parked} (seq {seq}) could go ahead: order is {order.status}, "
            f"last_seq {order.last_seq}, yet nothing released it"
        )
    return stuck


class Consumer(RuleBasedStateMachine):
    """Two orders' messages, delivered in any order, any number of times, one at a time or
    in batches, crashing anywhere; a delivery that crashed is delivered again."""

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
        #: Deliveries a worker died in, which the broker will hand over again:
        #: ``(consumer, messages, batched)``.
        self.owed: list[tuple[str, list[dict[str, Any]], bool]] = []

    def _pick(self, index: int) -> Planned:
        return self.planned[index % len(self.planned)]

    @rule(index=st.integers(0, 63))
    def deliver(self, index: int) -> None:
        p = self._pick(index)
        outcome = consume_message(p.message, consumer=p.consumer)
        assert outcome in set(Outcome)

    @rule(
        index=st.integers(0, 63),
        point=st.sampled_from(sorted(CRASH_POINTS)),
        at_once=st.booleans(),
    )
    def crash(self, index: int, point: str, at_once: bool) -> None:
        p = self._pick(index)
        with contextlib.suppress(Crash), CRASH_POINTS[point]():
            consume_message(p.message, consumer=p.consumer)
            return  # the crash point was not on this message's path
        self.crashes += 1
        self.owed.append((p.consumer, [p.message], False))
        if at_once:  # the broker's redelivery comes before anything else
            self.redeliver()

    @rule(
        indices=st.lists(st.integers(0, 63), min_size=1, max_size=6),
        point=st.sampled_from([None, *sorted(BATCH_CRASH_POINTS)]),
        at_once=st.booleans(),
    )
    def deliver_batch(self, indices: list[int], point: str | None, at_once: bool) -> None:
        """One consume_batch call (one consumer's messages), possibly dying at ``point``."""
        picked = [self._pick(i) for i in indices]
        consumer = picked[0].consumer
        messages = [p.message for p in picked if p.consumer == consumer]
        if point is None:
            outcomes = consume_batch(messages, consumer=consumer)
            assert set(outcomes) <= set(Outcome)
            return
        with contextlib.suppress(Crash), BATCH_CRASH_POINTS[point]():
            consume_batch(messages, consumer=consumer)
            return  # the crash point was not on this batch's path
        self.crashes += 1
        self.owed.append((consumer, messages, True))
        if at_once:
            self.redeliver()

    @precondition(lambda self: bool(self.owed))
    @rule()
    def redeliver(self) -> None:
        """The broker hands the latest delivery a worker died in over again, as it was."""
        consumer, messages, batched = self.owed.pop()
        if batched:
            consume_batch(messages, consumer=consumer)
        else:
            consume_message(messages[0], consumer=consumer)

    @invariant()
    def nothing_releasable_left_parked(self) -> None:
        # While a crashed delivery is still owed, its successors may wait for it.
        if not self.owed:
            stuck = releasable_but_parked(self.orders)
            assert not stuck, stuck

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
        while self.owed:
            self.redeliver()
        for p in self.planned:
            consume_message(p.message, consumer=p.consumer)
        report = check_invariants(self.planned, {o.pk: OrderStatus.COMPLETED for o in self.orders})
        assert not report.violations, report.violations


@pytest.mark.races
def test_consumer_state_machine(transactional_db: None) -> None:
    run_state_machine_as_test(Consumer)


@pytest.mark.races
def test_consumer_state_machine_on_the_save_road(transactional_db: None) -> None:
    """The same with a ``post_save`` receiver on Order: every transition is the model's own
    ``save()``, its UPDATE held for the next text where the database takes it. The receiver
    reads the order back on every other order (its statement carries the held UPDATEs and
    takes the message's savepoint in a batch) and sends nothing on the rest."""
    from django.db.models.signals import post_save

    from idempotent_orders.consuming.running import road

    def receiver(sender: Any, instance: Order, created: bool, **kwargs: Any) -> None:
        if not created and instance.pk % 2 == 0:
            row = Order.objects.values_list("status", "version").get(pk=instance.pk)
            assert row == (instance.status, instance.version), row

    post_save.connect(receiver, sender=Order, weak=False, dispatch_uid="prop-save-road")
    try:
        assert road(Order, "pay")[0] == "save"
        run_state_machine_as_test(Consumer)
    finally:
        post_save.disconnect(sender=Order, dispatch_uid="prop-save-road")


def test_batch_redelivered_after_dying_before_release_releases(transactional_db: None) -> None:
    """A batch whose worker died after its commit, before the release, is delivered again.

    The found step of the state machine, kept as a plain test: the redelivery must
    release the dispatch that waits for the batch's payment.
    """
    orders = make_orders(1, prefix="prop")
    pay, ship, _ = lifecycle(orders[0], run="batch-release", with_seq=True)
    assert consume_message(ship.message, consumer=ship.consumer) == Outcome.PARKED
    with contextlib.suppress(Crash), BATCH_CRASH_POINTS["batch_before_release"]():
        consume_batch([pay.message], consumer=pay.consumer)
    # The batch releases what it unblocks in its own transaction: nothing waits
    # for the after-commit pass a crash could cut short.
    assert releasable_but_parked(orders) == []
    consume_batch([pay.message], consumer=pay.consumer)  # the broker's redelivery
    assert releasable_but_parked(orders) == []


@pytest.fixture
def _no_crash_points_leak() -> Iterator[None]:
    yield
    assert single.release_parked.__name__ == "release_parked"


@pytest.mark.usefixtures("_no_crash_points_leak")
def test_crash_points_are_restored(transactional_db: None) -> None:
    orders = make_orders(1, prefix="prop")
    pay = lifecycle(orders[0], run="restore", with_seq=False)[0]
    with contextlib.suppress(Crash), CRASH_POINTS["after_update"]():
        consume_message(pay.message, consumer=pay.consumer)
    assert not ProcessedMessage.objects.filter(message_id=pay.key[1]).exists()  # rolled back
    assert consume_message(pay.message, consumer=pay.consumer) == Outcome.APPLIED
