"""Shared fixtures: orders, message builders, service requirements and real Celery workers."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.conf import settings

from idempotent_orders.models import Order

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "backends(*vendors): run only on these database vendors (sqlite, postgresql, mysql)",
    )


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


def service_reachable(url: str, timeout: float = 1.0) -> bool:
    parts = urlsplit(url)
    default_port = {"redis": 6379, "amqp": 5672, "postgres": 5432, "mysql": 3306}.get(
        parts.scheme, 0
    )
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), timeout
        ):
            return True
    except OSError:
        return False


def require_service(name: str, url: str) -> None:
    """Fail in CI, skip elsewhere, when a service the test needs is unreachable."""
    if service_reachable(url):
        return
    message = f"{name} is not reachable at {url}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: services are required)")
    pytest.skip(f"{message}; start it to run this test")


_counter = itertools.count(1)


@pytest.fixture
def make_order() -> Callable[..., Order]:
    def make(**kwargs: Any) -> Order:
        kwargs.setdefault("business_key", f"order-{uuid.uuid4().hex}")
        kwargs.setdefault("amount", Decimal("12.50"))
        kwargs.setdefault("currency", "CNY")
        return Order.objects.create(**kwargs)

    return make


def payment(
    order: Order, *, message_id: str | None = None, seq: int | None = None, **payload: Any
) -> dict[str, Any]:
    body = {
        "payment_id": f"pay-{order.pk}",
        "amount": str(order.amount),
        "currency": order.currency,
    }
    body.update(payload)
    msg: dict[str, Any] = {
        "message_id": message_id or f"pay-msg-{order.pk}-{next(_counter)}",
        "type": "payment.succeeded",
        "order_id": order.pk,
        "payload": body,
    }
    if seq is not None:
        msg["seq"] = seq
    return msg


def shipment(
    order: Order,
    kind: str = "dispatched",
    *,
    message_id: str | None = None,
    seq: int | None = None,
    **payload: Any,
) -> dict[str, Any]:
    body = {"tracking_number": f"TRK{order.pk}", "carrier": "sf-express"}
    body.update(payload)
    msg: dict[str, Any] = {
        "message_id": message_id or f"ship-{kind}-{order.pk}-{next(_counter)}",
        "type": f"shipment.{kind}",
        "order_id": order.pk,
        "payload": body,
    }
    if seq is not None:
        msg["seq"] = seq
    return msg


class Workers:
    """Real ``celery worker`` processes on a private queue, against the test database."""

    def __init__(self, broker_url: str, queue: str, env: dict[str, str]) -> None:
        self.broker_url = broker_url
        self.queue = queue
        self.env = env
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start(self, processes: int = 2, concurrency: int = 1) -> None:
        for _ in range(processes):
            log = Path(os.environ.get("TMPDIR", "/tmp")) / f"{self.queue}-{len(self.procs)}.log"
            self.logs.append(log)
            handle = log.open("wb")
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "demo_project",
                    "worker",
                    "-Q",
                    self.queue,
                    "-c",
                    str(concurrency),
                    "-P",
                    "prefork",
                    "-n",
                    f"{self.queue}-{len(self.procs)}@%h",
                    "--loglevel",
                    "INFO",
                    "--without-gossip",
                    "--without-mingle",
                    "--without-heartbeat",
                ],
                cwd=ROOT,
                env=self.env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.procs.append(proc)

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[index]
        os.killpg(proc.pid, sig)
        proc.wait(30)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def log_tail(self, chars: int = 4000) -> str:
        return "\n".join(
            f"--- {log}\n{log.read_text(errors='replace')[-chars:]}"
            for log in self.logs
            if log.exists()
        )


BROKERS = {
    "redis": lambda: settings.REDIS_URL.rsplit("/", 1)[0] + "/1",
    "rabbitmq": lambda: settings.RABBITMQ_URL,
}


@pytest.fixture
def celery_workers(transactional_db: None) -> Iterator[Callable[..., Workers]]:
    """Factory: ``celery_workers("redis" | "rabbitmq")`` starts worker processes."""
    from celery import current_app

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
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "IO_WORKER_DB": "1",
            "IO_TEST_BROKER_URL": url,
            "IO_TEST_QUEUE": queue,
            **(extra_env or {}),
        }
        current_app.conf.broker_url = url
        current_app.conf.task_default_queue = queue
        _reset_broker_pools(current_app)
        workers = Workers(url, queue, env)
        workers.start(processes, concurrency)
        started.append(workers)
        return workers

    yield start
    for workers in started:
        workers.stop()
        try:
            with current_app.connection_for_write() as conn:
                conn.default_channel.queue_delete(workers.queue)
        except Exception:
            pass
    current_app.conf.broker_url = conf_before.get("broker_url")
    current_app.conf.task_default_queue = conf_before.get("task_default_queue")
    _reset_broker_pools(current_app)


def _reset_broker_pools(app: Any) -> None:
    """Close the app's broker connections so the next publish uses the current broker URL.

    kombu keeps closed pools in global registries keyed by URL and never reopens
    them, so the registries are cleared too, not only the app's references.
    """
    from kombu import pools

    pools.reset()
    app._pool = None
    app.amqp._producer_pool = None


def wait_until(predicate: Callable[[], bool], timeout: float = 60, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


_dedup_cache_ok = True


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

            cache.delete_pattern("processed:*")  # type: ignore[attr-defined]
        except Exception:
            _dedup_cache_ok = False  # Redis is not running here; tests needing it say so
    yield
    dedup.reset()
