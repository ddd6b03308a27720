"""Fixtures of the fast path's tests: a private Redis, and the layers that answered."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from idempotent_orders import dedup
from idempotent_orders.dedup import Layer
from idempotent_orders.signals import dedup_answered
from tests.support.services import RedisServer, private_redis_settings


@pytest.fixture
def layers() -> Iterator[list[str]]:
    """The layer of each ``dedup_answered``, in order."""
    answered: list[str] = []

    def record(sender: Any, layer: Layer, **kwargs: Any) -> None:
        answered.append(layer.value)

    dedup_answered.connect(record)
    yield answered
    dedup_answered.disconnect(record)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A Redis server of the test's own, the dedup cache for the test."""
    server = RedisServer()
    server.start()
    with private_redis_settings(server.url):
        dedup.reset()
        yield server
    server.stop()
    dedup.reset()
