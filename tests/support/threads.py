"""Deliver messages from several threads at once, each with its own database connection."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from django.db import close_old_connections, connection

from idempotent_orders.consuming.single import consume_message


def run_threads(deliveries: list[tuple[str, dict[str, Any]]], threads: int) -> Counter[str]:
    """Consume ``deliveries`` (consumer, message) on ``threads`` threads started together.

    Returns the count of each outcome; fails if any thread raised.
    """
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    barrier = threading.Barrier(threads)
    chunks = [deliveries[i::threads] for i in range(threads)]
    errors: list[BaseException] = []

    def work(chunk: list[tuple[str, dict[str, Any]]]) -> None:
        try:
            barrier.wait()
            for consumer, message in chunk:
                outcome = consume_message(message, consumer=consumer)
                with lock:
                    outcomes[outcome.value] += 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            close_old_connections()
            connection.close()

    pool = [threading.Thread(target=work, args=(c,)) for c in chunks]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors
    return outcomes


def elsewhere(work: Callable[[], Any]) -> None:
    """``work`` on a connection of its own (another writer), committed when it returns."""

    def run() -> None:
        try:
            work()
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()


def after_the_read(monkeypatch: pytest.MonkeyPatch, change: Callable[[], Any]) -> list[int]:
    """Another writer runs ``change`` between the road's read of the order and its write,
    once; the versions the road read, in order."""
    from idempotent_orders.consuming import writing

    real = writing.decide
    versions: list[int] = []

    def racing(order: Any, envelope: Any) -> Any:
        versions.append(order.version)
        if len(versions) == 1:
            elsewhere(change)
        return real(order, envelope)

    monkeypatch.setattr(writing, "decide", racing)
    return versions
