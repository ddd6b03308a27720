"""Shared fixtures (orders, real Celery workers, a fresh fast path) and collection rules."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from hypothesis.configuration import set_hypothesis_home_dir

from idempotent_orders import get_order_model

# The testing kit's fixture, whether or not the app's pytest11 entry point is installed
# (a conftest fixture overrides the plugin's own).
from idempotent_orders.testing.plugin import exactly_once  # noqa: F401
from tests.support.scratch import SCRATCH
from tests.support.services import (
    BROKERS,
    ROOT,
    Workers,
    require_service,
    require_workers_marker,
    reset_broker_pools,
    worker_env,
)

# Hypothesis keeps its examples and caches in the tests' scratch folder, not the checkout.
set_hypothesis_home_dir(SCRATCH / "hypothesis")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "backends(*vendors): run only on these database vendors (sqlite, postgresql, mysql)",
    )


#: The suites of the projects' own order models, by the model each runs on.
OWN_MODEL_SUITES = {
    "shop.Order": ROOT / "tests" / "swapped",
    "history.Order": ROOT / "tests" / "history",
    "djshop.Order": ROOT / "tests" / "djshop",
}


def pytest_ignore_collect(collection_path: Any, config: pytest.Config) -> bool | None:
    """Under an own model's settings only its suite runs; elsewhere none of them does.

    The order model is chosen once per process (as the user model is), so the
    suite for a project's own model runs in its own pytest process
    (``DJANGO_SETTINGS_MODULE=tests.settings_swapped`` or ``tests.settings_history``;
    tests/support/matrix.py runs them all).
    """
    from idempotent_orders.conf import order_model_label

    path = Path(str(collection_path))
    if path.suffix != ".py" and not path.is_dir():
        return None
    own = OWN_MODEL_SUITES.get(order_model_label())

    def inside(suite: Path) -> bool:
        return path == suite or suite in path.parents

    if own is not None:
        return not (inside(own) or path in own.parents)
    return any(inside(suite) for suite in OWN_MODEL_SUITES.values()) or None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from django.db import connection

    vendor = connection.vendor
    for item in items:
        marker = item.get_closest_marker("backends")
        if marker and vendor not in marker.args:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"runs on {', '.join(marker.args)}; this matrix leg is {vendor}"
                )
            )


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None, django_db_blocker: Any) -> None:
    """With ``IO_TEST_PARTITIONED_INBOX=1``, the test database's inbox partitioned by day."""
    from idempotent_orders.partitioning import convert, partitioned_inbox

    if partitioned_inbox():
        with django_db_blocker.unblock():
            convert()


@pytest.fixture
def staff() -> Client:
    """A test client logged in as a superuser (the admin's operator)."""
    user = get_user_model().objects.create_superuser("operator", "op@example.com", "pw")
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def make_order() -> Callable[..., Any]:
    """Factory of orders of the configured order model (``shop.Order`` in the swapped suite)."""

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("business_key", f"order-{uuid.uuid4().hex}")
        kwargs.setdefault("amount", Decimal("12.50"))
        kwargs.setdefault("currency", "CNY")
        return get_order_model()._default_manager.create(**kwargs)

    return make


@pytest.fixture
def fulfil() -> Iterator[None]:
    """The default configuration's follow-up on; its rows stay pending (no broker here)."""
    from django.conf import settings
    from django.test.utils import override_settings

    config = {
        **settings.IDEMPOTENT_ORDERS,
        "FULFIL_AFTER_PAYMENT": True,
        "OUTBOX_PUBLISH_ON_COMMIT": False,
    }
    with override_settings(IDEMPOTENT_ORDERS=config):
        yield


@pytest.fixture
def celery_workers(
    transactional_db: None, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Workers]]:
    """Factory: ``celery_workers("redis" | "rabbitmq")`` starts worker processes."""
    from celery import current_app

    require_workers_marker(request)

    started: list[Workers] = []
    # Only the keys we change: iterating the whole conf touches every Django
    # setting, deprecated ones included.
    conf_before = {key: current_app.conf.get(key) for key in ("broker_url", "task_default_queue")}

    def start(
        broker: str,
        processes: int = 2,
        concurrency: int = 1,
        extra_env: dict[str, str] | None = None,
    ) -> Workers:
        url = BROKERS[broker]()
        require_service(broker, url)
        queue = f"io-test-{uuid.uuid4().hex[:10]}"
        env = worker_env(broker_url=url, queue=queue, **(extra_env or {}))
        current_app.conf.broker_url = url
        current_app.conf.task_default_queue = queue
        reset_broker_pools(current_app)
        workers = Workers(url, queue, env)
        workers.start(processes, concurrency)
        started.append(workers)
        return workers

    yield start
    for workers in started:
        workers.discard()
    current_app.conf.broker_url = conf_before.get("broker_url")
    current_app.conf.task_default_queue = conf_before.get("task_default_queue")
    reset_broker_pools(current_app)


_dedup_cache_ok = True


@pytest.fixture(autouse=True)
def _closed_outbox_breaker() -> Iterator[None]:
    """Each test starts with the outbox relay's broker breaker closed."""
    from idempotent_orders.outbox import breaker

    breaker.reset()
    yield
    breaker.reset()


@pytest.fixture(scope="session", autouse=True)
def _no_keys_left_behind() -> Iterator[None]:
    """The run deletes every Redis key under its KEY_PREFIX when it ends.

    Some keys have no expiry (fencing tokens, counters): left behind, they would be
    walked by every later run's per-test cleanup in the same database.
    """
    yield
    if _dedup_cache_ok:
        try:
            from django.core.cache import cache

            cache.delete_pattern("*", itersize=10_000)  # type: ignore[attr-defined]
        except Exception:
            pass  # Redis is not running here


@pytest.fixture(autouse=True)
def _fresh_fast_path() -> Iterator[None]:
    """Each test starts with empty Bloom filters and none of this namespace's Redis keys.

    The database is reset between tests but Redis is not: a ``processed:`` key
    left by an earlier test would answer "duplicate" for a reused message id.
    Only keys under this run's KEY_PREFIX are deleted (never FLUSHDB).
    """
    global _dedup_cache_ok
    from idempotent_orders import dedup, stats

    dedup.reset()
    stats.reset()
    if _dedup_cache_ok:
        try:
            from django.core.cache import cache

            # A SCAN of the whole logical database: the tests have databases of their
            # own (tests/settings.py; one per leg running in tests/support/matrix.py), so it
            # walks this run's keys and few others. A large SCAN count walks those in a
            # call or two, not in one call per ten keys.
            cache.delete_pattern("processed:*", itersize=10_000)  # type: ignore[attr-defined]
            cache.delete_pattern("bloom-snapshot:*", itersize=10_000)  # type: ignore[attr-defined]
        except Exception:
            _dedup_cache_ok = False  # Redis is not running here; tests needing it say so
    yield
    dedup.bloom.wait_snapshot(30)  # a snapshot written in the background is not the next test's
    dedup.reset()
