"""The testing kit's functions: storms of duplicated deliveries, crashes, the invariant.

A delivery is a ``(consumer, message)`` pair, as a broker hands it to a consumer.
"""

from __future__ import annotations

import asyncio
import collections
import random
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.db import close_old_connections, connection

from idempotent_orders import get_order_model
from idempotent_orders.consuming.aio import aconsume_message
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.graph import state_field
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import InboxStatus, Outcome, ParkedMessage, ProcessedMessage
from idempotent_orders.testing import effects
from idempotent_orders.testing.effects import Effect, EffectBeforeCommit, Effects, watch_effects

__all__ = [
    "CRASH_POINTS",
    "Delivery",
    "Effect",
    "EffectBeforeCommit",
    "Effects",
    "ExactlyOnce",
    "WorkerDied",
    "assert_exactly_once",
    "crash_at",
    "deliver",
    "deliver_from_event_loop",
    "deliver_from_threads",
    "deliver_in_batches",
    "shuffled_copies",
    "watch_effects",
]

#: ``(consumer, message)``: one delivery of a message to a consumer.
Delivery = tuple[str, Mapping[str, Any]]

#: Outcomes a message may end with once every delivery was handled (never parked or failed).
FINAL = {Outcome.APPLIED, Outcome.DUPLICATE, Outcome.STALE, Outcome.REJECTED}


# --- storms ---------------------------------------------------------------------------------


def shuffled_copies(
    messages: Iterable[Delivery],
    *,
    copies: int | tuple[int, int] = (1, 4),
    rng: random.Random | None = None,
    seed: int = 0,
) -> list[Delivery]:
    """Each delivery ``copies`` times (an int, or a random count in ``(low, high)``), shuffled.

    Reproducible: from ``rng``, or a generator seeded with ``seed``.
    """
    rng = rng or random.Random(seed)
    out: list[Delivery] = []
    for delivery in messages:
        count = copies if isinstance(copies, int) else rng.randint(*copies)
        out += [delivery] * count
    rng.shuffle(out)
    return out


def deliver(deliveries: Iterable[Delivery]) -> collections.Counter[Outcome]:
    """Consume each delivery with ``consume_message``, in order; the count of each outcome."""
    outcomes: collections.Counter[Outcome] = collections.Counter()
    for consumer, message in deliveries:
        with effects.delivery(_label(consumer, message)):
            outcomes[consume_message(dict(message), consumer=consumer)] += 1
    return outcomes


def _label(consumer: str, message: Mapping[str, Any]) -> str:
    return f"{consumer}/{message.get('message_id')}"


def deliver_in_batches(
    deliveries: Sequence[Delivery], *, size: int = 50
) -> collections.Counter[Outcome]:
    """Consume the deliveries with ``consume_batch``: ``size`` at a time, one batch per
    consumer within each slice (the slice's order kept within a consumer)."""
    outcomes: collections.Counter[Outcome] = collections.Counter()
    for start in range(0, len(deliveries), size):
        by_consumer: dict[str, list[dict[str, Any]]] = {}
        for consumer, message in deliveries[start : start + size]:
            by_consumer.setdefault(consumer, []).append(dict(message))
        for consumer, batch in by_consumer.items():
            with effects.delivery(f"a batch of {len(batch)} to {consumer}"):
                outcomes.update(consume_batch(batch, consumer=consumer))
    return outcomes


def deliver_from_threads(
    deliveries: Sequence[Delivery], *, threads: int = 4
) -> collections.Counter[Outcome]:
    """Consume the deliveries on ``threads`` threads started together, each with its own
    database connection (so the test needs ``django_db(transaction=True)``).

    The count of each outcome; re-raises the first error a thread met.
    """
    outcomes: collections.Counter[Outcome] = collections.Counter()
    lock = threading.Lock()
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def work(chunk: Sequence[Delivery]) -> None:
        try:
            barrier.wait()
            for consumer, message in chunk:
                with effects.delivery(_label(consumer, message)):
                    outcome = consume_message(dict(message), consumer=consumer)
                with lock:
                    outcomes[outcome] += 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            close_old_connections()
            connection.close()

    pool = [
        threading.Thread(target=work, args=(deliveries[i::threads],), name=f"storm-{i}")
        for i in range(threads)
    ]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]
    return outcomes


def deliver_from_event_loop(deliveries: Sequence[Delivery]) -> collections.Counter[Outcome]:
    """Consume every delivery at once from an event loop (``asyncio.gather`` of
    ``aconsume_message``); needs ``django_db(transaction=True)``. Call it from sync code."""

    async def one(consumer: str, message: Mapping[str, Any]) -> Outcome:
        with effects.delivery(_label(consumer, message)):
            return await aconsume_message(dict(message), consumer=consumer)

    async def storm() -> list[Outcome]:
        return await asyncio.gather(*(one(consumer, message) for consumer, message in deliveries))

    return collections.Counter(asyncio.run(storm()))


# --- crashes --------------------------------------------------------------------------------


class WorkerDied(BaseException):
    """The worker died at a crash point. A ``BaseException``, as the consumer's own
    ``except Exception`` (which keeps a ``failed`` row) never sees a death: the
    transaction rolls back and nothing is written, as when a process is killed."""


#: The named points :func:`crash_at` can kill a delivery at.
CRASH_POINTS = {
    # The inbox row is inserted (the message is claimed); the order is not written yet.
    "after_inbox_insert": "INSERT",
    # The order's conditional UPDATE ran; its transaction has not committed.
    "after_order_update": "UPDATE",
}


@dataclass
class Crash:
    """An armed crash point; ``fired`` counts the deliveries it killed."""

    point: str
    times: int
    fired: int = 0


@contextmanager
def crash_at(point: str, *, times: int = 1) -> Iterator[Crash]:
    """Kill the next ``times`` deliveries in this thread at ``point`` (:data:`CRASH_POINTS`),
    raising :class:`WorkerDied`; later deliveries in the block run normally.

    The statement that reaches the point runs, then the worker dies before its
    transaction commits, so the database rolls it all back. On PostgreSQL's
    one-statement road (inbox row and UPDATE in one autocommitted statement) the
    worker dies just before that statement instead: the same nothing-written.
    Fails at the end of the block if the point was never reached.
    """
    if point not in CRASH_POINTS:
        raise ValueError(f"unknown crash point {point!r}; one of {sorted(CRASH_POINTS)}")
    verb = CRASH_POINTS[point]
    if verb == "INSERT":
        table = ProcessedMessage._meta.db_table
        pattern = rf"\bINSERT\s+(?:IGNORE\s+)?INTO\s+[\"`]?{re.escape(table)}[\"`]?"
    else:
        table = get_order_model()._meta.db_table
        pattern = rf"\bUPDATE\s+[\"`]?{re.escape(table)}[\"`]?[\s(]"
    matches = re.compile(pattern, re.IGNORECASE).search
    crash = Crash(point, times)

    def wrapper(
        execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        if crash.fired >= crash.times or not matches(sql):
            return execute(sql, params, many, context)
        crash.fired += 1
        _died(point)
        if not connection.in_atomic_block:
            raise WorkerDied(f"worker died before its autocommitted statement ({point})")
        # A text that commits itself (PostgreSQL's "UPDATE ...; COMMIT" in one round
        # trip) runs without its COMMIT: the worker dies before it, as a killed one would.
        body, commits = _without_commit(sql)
        if commits is None:
            raise WorkerDied(f"worker died before a statement that commits ({point})")
        execute(body, params, many, context)
        raise WorkerDied(f"worker died {point.replace('_', ' ')}, before commit")

    with connection.execute_wrapper(wrapper):
        yield crash
    if not crash.fired:
        raise AssertionError(f"crash point {point!r} was never reached")


#: ``; COMMIT`` ending a text of several statements.
_TRAILING_COMMIT = re.compile(r";\s*COMMIT\s*;?\s*$", re.IGNORECASE)
#: ``COMMIT`` as a statement of its own anywhere in a text.
_ANY_COMMIT = re.compile(r"(?:^|;)\s*COMMIT\b", re.IGNORECASE)


def _without_commit(sql: str) -> tuple[str, bool | None]:
    """``sql`` without a trailing ``; COMMIT`` and whether it had one; ``(sql, None)``
    when it commits elsewhere than at its end (it cannot run without committing)."""
    body = _TRAILING_COMMIT.sub("", sql)
    if _ANY_COMMIT.search(body):
        return sql, None
    return body, body != sql


def _died(point: str) -> None:
    """Tell the effect watchers (:mod:`idempotent_orders.testing.effects`) that this
    context's delivery dies at ``point``."""
    effects.worker_died(point)


# --- the invariant --------------------------------------------------------------------------


def assert_exactly_once(
    orders: Iterable[Any],
    messages: Iterable[Delivery],
    *,
    expect: Outcome | None = Outcome.APPLIED,
    states: Mapping[Any, Any] | None = None,
    baseline: Mapping[Any, int] | None = None,
) -> None:
    """Assert, from the database, that every message was handled exactly once (and, inside
    :func:`watch_effects`, that no watched effect ran twice for one business event).

    - every message (``(consumer, message)`` pairs; copies are counted once) has its
      one inbox row, with a final outcome (``expect`` when given; None accepts applied,
      duplicate, stale or rejected), never left processing, failed or parked;
    - nothing is left parked for these orders;
    - each order's ``version`` is its ``baseline`` (0: a new order) plus its applied
      inbox rows, so no transition ran twice and none was lost;
    - each order is in ``states[pk]`` when ``states`` names it.
    """
    model = get_order_model()
    state = state_field(model).attname
    pks = [getattr(o, "pk", o) for o in orders]
    keys = {(consumer, str(message["message_id"])) for consumer, message in messages}
    problems: list[str] = []
    rows = {
        (r.consumer, r.message_id): r
        for r in ProcessedMessage.objects.filter(message_id__in={k[1] for k in keys})
    }
    for key in sorted(keys):
        row = rows.get(key)
        if row is None:
            problems.append(f"{key}: no inbox row (the message was lost)")
        elif row.status in (InboxStatus.PROCESSING, InboxStatus.FAILED, InboxStatus.DEAD):
            problems.append(f"{key}: left {row.status} ({row.error})")
        elif row.outcome not in FINAL:
            problems.append(f"{key}: outcome {row.outcome!r} is not final ({row.error})")
        elif expect is not None and row.outcome != expect:
            problems.append(f"{key}: {row.outcome}, expected {expect.value} ({row.error})")
    for parked in ParkedMessage.objects.filter(order_id__in=pks):
        problems.append(f"{parked.consumer}/{parked.message_id}: left parked ({parked.reason})")
    applied = collections.Counter(
        ProcessedMessage.objects.filter(order_id__in=pks, outcome=Outcome.APPLIED).values_list(
            "order_id", flat=True
        )
    )
    found = {
        pk: (v, s)
        for pk, v, s in model._default_manager.filter(pk__in=pks).values_list(
            "pk", "version", state
        )
    }
    for pk in pks:
        if pk not in found:
            problems.append(f"order {pk}: does not exist")
            continue
        version, current = found[pk]
        start = (baseline or {}).get(pk, 0)
        if version != start + applied[pk]:
            problems.append(
                f"order {pk}: version {version}, but {start} + {applied[pk]} applied messages"
            )
        if states is not None and pk in states and current != states[pk]:
            problems.append(f"order {pk}: in {current!r}, expected {states[pk]!r}")
    # The effects outside the database, when the test watches them (watch_effects).
    problems += effects.active_problems()
    if problems:
        raise AssertionError("exactly-once violated:\n  " + "\n  ".join(problems))


# --- the fixture's object -------------------------------------------------------------------


@dataclass
class ExactlyOnce:
    """What the ``exactly_once`` fixture gives a test: the kit, with ``rng`` seeded from the
    test's id (reproducible; ``seed`` is shown in a failure's report)."""

    seed: int
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def shuffled_copies(
        self, messages: Iterable[Delivery], *, copies: int | tuple[int, int] = (1, 4)
    ) -> list[Delivery]:
        return shuffled_copies(messages, copies=copies, rng=self.rng)

    deliver = staticmethod(deliver)
    deliver_in_batches = staticmethod(deliver_in_batches)
    deliver_from_threads = staticmethod(deliver_from_threads)
    deliver_from_event_loop = staticmethod(deliver_from_event_loop)
    crash_at = staticmethod(crash_at)
    assert_exactly_once = staticmethod(assert_exactly_once)
    watch_effects = staticmethod(watch_effects)
    WorkerDied = WorkerDied
    Effect = Effect
    EffectBeforeCommit = EffectBeforeCommit
    Effects = Effects
