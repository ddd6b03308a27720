"""Services a test needs (fail in CI, skip elsewhere) and processes it owns: a private
``redis-server``, real Celery workers, broker-pool reset."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import pytest
from django.conf import settings
from django.test import override_settings

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def unavailable(
    reason: str, *, hint: str = "", required: str = "services are required"
) -> NoReturn:
    """Fail in CI (where everything must run), skip elsewhere, saying what is missing."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: {required})")
    pytest.skip(f"{reason}; {hint}" if hint else reason)


def require_program(*names: str) -> None:
    """Fail in CI, skip elsewhere, when a program the test runs is not installed."""
    missing = [name for name in names if shutil.which(name) is None]
    if missing:
        unavailable(f"{', '.join(missing)} not installed", hint="install it to run this test")


def wait_until(predicate: Callable[[], bool], timeout: float = 60, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    unavailable(f"{name} is not reachable at {url}", hint="start it to run this test")


#: Broker URLs of the worker tests, by name (read from the settings when called).
BROKERS: dict[str, Callable[[], str]] = {
    "redis": lambda: settings.REDIS_URL.rsplit("/", 1)[0] + "/1",
    "rabbitmq": lambda: settings.RABBITMQ_URL,
}


# --- a private redis-server -----------------------------------------------------------------


class RedisServer:
    """A throwaway ``redis-server`` a test may flush, stop or restart (never the shared one).

    No persistence: restarting it loses everything, like a FLUSHALL.
    """

    def __init__(self, *options: str) -> None:
        self.port = free_port()
        self.url = self.db_url(0)
        self.proc: subprocess.Popen[bytes] | None = None
        #: Extra ``redis-server`` options, e.g. ``--rename-command CLIENT ""``.
        self.options = options

    def db_url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        require_program("redis-server", "redis-cli")
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--dir",
                tempfile.gettempdir(),
                *self.options,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.cli("PING") == "PONG":
                    return
            except subprocess.CalledProcessError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"private redis-server did not start on port {self.port}")

    def cli(self, *args: str) -> str:
        return subprocess.run(
            ["redis-cli", "-p", str(self.port), *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()

    def keys(self, pattern: str) -> list[str]:
        return [k for k in self.cli("--scan", "--pattern", pattern).splitlines() if k]

    def ttl(self, key: str) -> int:
        return int(self.cli("TTL", key))

    def flushall(self) -> None:
        self.cli("FLUSHALL")  # our own server only

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self, down_for: float = 1.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()


@contextmanager
def private_redis_settings(url: str) -> Iterator[None]:
    """Point the dedup layer and the counters at ``url`` under the alias ``dedup``."""
    caches: dict[str, Any] = {
        **settings.CACHES,
        "dedup": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": url,
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 0.5},
        },
    }
    values = {**settings.IDEMPOTENT_ORDERS, "DEDUP_CACHE_ALIAS": "dedup"}
    with override_settings(CACHES=caches, IDEMPOTENT_ORDERS=values):
        yield


# --- real Celery workers --------------------------------------------------------------------


def worker_env(
    *, broker_url: str, queue: str, settings_module: str | None = None, **extra: str
) -> dict[str, str]:
    """Environment of a worker process: the test database, a private queue, the given broker.

    The settings default to the test run's own (the swapped suite's workers use its model).
    """
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": settings_module
        or os.environ.get("DJANGO_SETTINGS_MODULE", "tests.settings"),
        "IO_WORKER_DB": "1",
        "IO_TEST_BROKER_URL": broker_url,
        "IO_TEST_QUEUE": queue,
        **extra,
    }


class Workers:
    """Real ``celery worker`` processes (prefork) on one queue; each can be killed, replaced."""

    def __init__(self, broker_url: str, queue: str, env: dict[str, str]) -> None:
        self.broker_url = broker_url
        self.queue = queue
        self.env = env
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self._names = itertools.count()
        self.concurrency = 1

    def spawn(self, concurrency: int = 1) -> subprocess.Popen[bytes]:
        """Start one worker in its own session, so a kill reaches its pool children too."""
        n = next(self._names)
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"{self.queue}-{n}.log"
        self.logs.append(log)
        with log.open("wb") as handle:
            return subprocess.Popen(
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
                    f"{self.queue}-{n}@%h",
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

    def start(self, processes: int = 2, concurrency: int = 1) -> None:
        self.concurrency = concurrency
        self.procs += [self.spawn(concurrency) for _ in range(processes)]

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Signal a worker's whole process group (parent and pool children) and reap it."""
        kill_group(self.procs[index], sig)

    def kill_holders(self, pids: Iterable[int]) -> list[int]:
        """SIGKILL each worker whose process group holds one of ``pids``; their indices."""
        groups = {os.getpgid(pid) for pid in pids}
        killed = [i for i, proc in enumerate(self.procs) if proc.pid in groups]
        for index in killed:
            self.kill(index)
        return killed

    def kill_and_restart(self, index: int) -> None:
        """SIGKILL a worker and start a new one in its place."""
        self.kill(index)
        self.procs[index] = self.spawn(self.concurrency)

    def stop(self) -> None:
        stop_processes(self.procs)

    def log_tail(self, chars: int = 4000, files: int = 6) -> str:
        return "\n".join(
            f"--- {log}\n{log.read_text(errors='replace')[-chars:]}"
            for log in self.logs[-files:]
            if log.exists()
        )


class BatchConsumers(Workers):
    """``manage.py consume_orders_in_batches`` processes on one queue, like :class:`Workers`."""

    def __init__(
        self,
        broker_url: str,
        queue: str,
        env: dict[str, str],
        *,
        batch_size: int = 100,
        flush_interval: float = 0.2,
    ) -> None:
        super().__init__(broker_url, queue, env)
        self.batch_size = batch_size
        self.flush_interval = flush_interval

    def spawn(self, concurrency: int = 1) -> subprocess.Popen[bytes]:
        n = next(self._names)
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"{self.queue}-batch-{n}.log"
        self.logs.append(log)
        with log.open("wb") as handle:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "django",
                    "consume_orders_in_batches",
                    "--queue",
                    self.queue,
                    "--broker",
                    self.broker_url,
                    "--batch-size",
                    str(self.batch_size),
                    "--flush-interval",
                    str(self.flush_interval),
                ],
                cwd=ROOT,
                env=self.env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )


def kill_group(proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
    """Signal the process group of ``proc`` (started with ``start_new_session``) and reap it."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    proc.wait(30)


def stop_processes(procs: list[subprocess.Popen[Any]], timeout: float = 20) -> None:
    """SIGTERM each process group, SIGKILL what is still running after ``timeout``."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def reset_broker_pools(app: Any = None) -> None:
    """Close this process's broker connections so the next publish uses the current broker URL.

    kombu keeps closed pools in global registries keyed by URL and never reopens
    them ("Acquire on closed pool"), so the registries are cleared too, not only
    the app's references.
    """
    from celery import current_app
    from kombu import pools

    app = app or current_app
    pools.reset()
    app._pool = None
    app.amqp._producer_pool = None
