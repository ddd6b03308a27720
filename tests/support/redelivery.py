"""Consumer threads fed by an in-memory queue with late acks: a delivery that raised goes
back to the queue, as a broker redelivers a message its worker did not acknowledge."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from idempotent_orders.consuming.failures import TRANSIENT
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import Outcome
from tests.support.chaos import Planned


@contextmanager
def database(settings_dict: dict[str, Any]) -> Iterator[None]:
    """Point the default alias at ``settings_dict`` in this thread and in every thread that
    opens a connection meanwhile; the test database's connection comes back after."""
    saved = connections.settings[DEFAULT_DB_ALIAS]
    previous = connections[DEFAULT_DB_ALIAS]
    connections.settings[DEFAULT_DB_ALIAS] = {**saved, **settings_dict}
    del connections[DEFAULT_DB_ALIAS]
    try:
        yield
    finally:
        with suppress(Exception):
            connections[DEFAULT_DB_ALIAS].close()
        connections.settings[DEFAULT_DB_ALIAS] = saved
        connections[DEFAULT_DB_ALIAS] = previous


@dataclass
class Ack:
    index: int
    outcome: Outcome
    #: When the acknowledged delivery began, and when it was acknowledged.
    began: float
    at: float


@dataclass
class LateAckQueue:
    """Deliveries (indexes into ``planned``) handed to consumers; each is acknowledged after
    its consume returned, or put back at the end of the queue when it raised."""

    planned: Sequence[Planned]
    deliveries: Sequence[int]
    pending: deque[int] = field(init=False)
    acks: list[Ack] = field(default_factory=list)
    #: Deliveries that raised and were put back, by the error's class name.
    redelivered: Counter[str] = field(default_factory=Counter)
    #: Indexes of the deliveries put back at least once.
    put_back_indexes: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.pending = deque(self.deliveries)

    def take(self) -> int | None:
        with self.lock:
            if not self.pending:
                return None
            self.in_flight += 1
            return self.pending.popleft()

    def ack(self, index: int, outcome: Outcome, began: float) -> None:
        with self.lock:
            self.acks.append(Ack(index, outcome, began, time.monotonic()))
            self.in_flight -= 1

    def put_back(self, index: int, error: BaseException) -> None:
        with self.lock:
            self.pending.append(index)
            self.redelivered[type(error).__name__] += 1
            self.put_back_indexes.add(index)
            self.in_flight -= 1

    @property
    def done(self) -> bool:
        with self.lock:
            return not self.pending and not self.in_flight

    def acked(self) -> int:
        with self.lock:
            return len(self.acks)


def consume_until_done(
    queue: LateAckQueue,
    *,
    threads: int,
    deadline: float,
    backoff: float = 0.05,
    consume: Callable[[dict[str, Any], str], Outcome] | None = None,
) -> list[threading.Thread]:
    """Start ``threads`` consumers on ``queue``; they stop when it is drained or at ``deadline``
    (``time.monotonic()``). A transient error closes the thread's connection (the next
    message opens a new one) and puts the delivery back."""
    run = consume or (lambda message, consumer: consume_message(message, consumer=consumer))

    def consumer() -> None:
        try:
            while time.monotonic() < deadline:
                index = queue.take()
                if index is None:
                    if queue.done:
                        return
                    time.sleep(0.01)
                    continue
                planned = queue.planned[index]
                began = time.monotonic()
                try:
                    outcome = run(planned.message, planned.consumer)
                except TRANSIENT as exc:
                    queue.put_back(index, exc)
                    with suppress(Exception):
                        connections[DEFAULT_DB_ALIAS].close()
                    time.sleep(backoff)
                    continue
                except Exception as exc:  # every other error is the test's finding
                    queue.put_back(index, exc)
                    with queue.lock:
                        queue.errors.append(f"{planned.key}: {exc!r}")
                    time.sleep(backoff)
                    continue
                queue.ack(index, outcome, began)
        finally:
            connections.close_all()

    started = [threading.Thread(target=consumer, name=f"consumer-{n}") for n in range(threads)]
    for thread in started:
        thread.start()
    return started
