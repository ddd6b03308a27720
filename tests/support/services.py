"""Services a test needs (fail in CI, skip elsewhere) and processes it owns: a private
``redis-server``, real Celery workers, broker-pool reset."""

from __future__ import annotations

import itertools
import os
import random
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


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10000) is free too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(20000, 50000)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisClusterServers:
    """A throwaway Redis Cluster of ``masters`` masters (no replicas), each a private
    ``redis-server`` on its own port and in its own temporary directory.

    A master can be killed (SIGKILL) or frozen (SIGSTOP); :meth:`stop` thaws and
    kills them all and removes the directories.
    """

    def __init__(self, masters: int = 3, node_timeout_ms: int = 15000) -> None:
        self.ports = [cluster_port() for _ in range(masters)]
        self.node_timeout_ms = node_timeout_ms
        self.commands: list[list[str]] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dirs: list[str] = []
        self.frozen: set[int] = set()

    @property
    def url(self) -> str:
        """One node's URL: the cluster client discovers the others."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> None:
        require_program("redis-server", "redis-cli")
        for port in self.ports:
            workdir = tempfile.mkdtemp(prefix=f"io-cluster-{port}-")
            self.dirs.append(workdir)
            self.commands.append(
                [
                    "redis-server",
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    os.path.join(workdir, "nodes.conf"),
                    "--cluster-node-timeout",
                    str(self.node_timeout_ms),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    workdir,
                ]
            )
            self.procs.append(self._spawn(self.commands[-1]))
        for port in self.ports:
            if not wait_until(lambda p=port: self._ping(p), timeout=10, interval=0.05):
                raise RuntimeError(f"cluster node on port {port} did not start")
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in self.ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            check=True,
            timeout=30,
        )
        if not wait_until(self.healthy, timeout=20, interval=0.1):
            raise RuntimeError("the local Redis Cluster did not reach cluster_state:ok")

    @staticmethod
    def _spawn(command: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def revive(self, index: int) -> None:
        """Start a killed master again (empty, its slots kept) and wait for the cluster."""
        self.kill(index)
        self.procs[index] = self._spawn(self.commands[index])
        port = self.ports[index]
        if not wait_until(lambda: self._ping(port), timeout=10, interval=0.05):
            raise RuntimeError(f"cluster node on port {port} did not start again")
        if not wait_until(self.healthy, timeout=30, interval=0.1):
            raise RuntimeError("the local Redis Cluster did not recover")

    def _ping(self, port: int) -> bool:
        try:
            return self.cli(port, "PING") == "PONG"
        except subprocess.SubprocessError:
            return False

    def cli(self, port: int, *args: str) -> str:
        return subprocess.run(
            ["redis-cli", "-p", str(port), *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=5,
        ).stdout.strip()

    def healthy(self) -> bool:
        try:
            return all(
                "cluster_state:ok" in self.cli(port, "CLUSTER", "INFO") for port in self.ports
            )
        except subprocess.SubprocessError:
            return False

    def keys(self, index: int, pattern: str) -> list[str]:
        """The keys matching ``pattern`` on master ``index``."""
        out = self.cli(self.ports[index], "--scan", "--pattern", pattern)
        return [k for k in out.splitlines() if k]

    def master_of(self, slot: int) -> int:
        """The index of the master serving ``slot`` (from each node's ``CLUSTER NODES``)."""
        for index, port in enumerate(self.ports):
            for line in self.cli(port, "CLUSTER", "NODES").splitlines():
                if "myself" not in line:
                    continue
                for ranged in line.split()[8:]:
                    start, _, end = ranged.partition("-")
                    if int(start) <= slot <= int(end or start):
                        return index
        raise LookupError(f"no master serves slot {slot}")

    def flushall(self) -> None:
        for port in self.ports:
            self.cli(port, "FLUSHALL")

    def kill(self, index: int) -> None:
        """SIGKILL master ``index`` (its slots stay without a master until :meth:`stop`)."""
        proc = self.procs[index]
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def freeze(self, index: int) -> None:
        """SIGSTOP master ``index``: connections are accepted, nothing is answered."""
        os.kill(self.procs[index].pid, signal.SIGSTOP)
        self.frozen.add(index)

    def thaw(self, index: int) -> None:
        if index in self.frozen and self.procs[index].poll() is None:
            os.kill(self.procs[index].pid, signal.SIGCONT)
        self.frozen.discard(index)

    def stop(self) -> None:
        for index in list(self.frozen):
            self.thaw(index)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for workdir in self.dirs:
            shutil.rmtree(workdir, ignore_errors=True)
        self.procs, self.dirs = [], []


class RedisSentinel:
    """A private ``redis-server --sentinel`` watching a :class:`RedisServer` as ``service``
    (its config file, which the sentinel rewrites, in a temporary directory)."""

    def __init__(self, master: RedisServer, service: str | None = None) -> None:
        self.master = master
        self.port = free_port()
        # A service name of its own: django-redis keeps a connection pool per LOCATION for
        # the whole process, and a pool left by an earlier test's sentinel (stopped) would
        # spend each connection of this one retrying that sentinel first.
        self.service = service or f"io-{self.port}"
        self.dir = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        require_program("redis-server", "redis-cli")
        self.dir = tempfile.mkdtemp(prefix=f"io-sentinel-{self.port}-")
        config = os.path.join(self.dir, "sentinel.conf")
        with open(config, "w") as handle:
            handle.write(
                f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 1\n"
                f"sentinel down-after-milliseconds {self.service} 5000\n"
            )
        self.proc = subprocess.Popen(
            ["redis-server", config, "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if not wait_until(self._knows_master, timeout=10, interval=0.05):
            raise RuntimeError(f"private sentinel did not start on port {self.port}")

    def _knows_master(self) -> bool:
        try:
            out = subprocess.run(
                [
                    "redis-cli",
                    "-p",
                    str(self.port),
                    "SENTINEL",
                    "get-master-addr-by-name",
                    self.service,
                ],
                capture_output=True,
                text=True,
                check=True,
                timeout=5,
            ).stdout
        except subprocess.SubprocessError:
            return False
        return str(self.master.port) in out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def cache(self) -> dict[str, Any]:
        """A django-redis cache through this sentinel, as docs/operations.md configures it."""
        return {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://{self.service}/0",
            "OPTIONS": {
                "CLIENT_CLASS": "django_redis.client.SentinelClient",
                "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
                "SENTINELS": [("127.0.0.1", self.port)],
                "SENTINEL_KWARGS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
                "SOCKET_CONNECT_TIMEOUT": 0.5,
                "SOCKET_TIMEOUT": 0.5,
            },
        }


def cluster_cache(url: str, **options: Any) -> dict[str, Any]:
    """A django-redis cache on a Redis Cluster, as docs/operations.md configures it."""
    return {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": url,
        "OPTIONS": {
            "CONNECTION_FACTORY": "idempotent_orders.dedup.cluster.ClusterConnectionFactory",
            "SOCKET_CONNECT_TIMEOUT": 0.5,
            "SOCKET_TIMEOUT": 0.5,
            **options,
        },
    }


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


def require_workers_marker(request: pytest.FixtureRequest) -> None:
    """Worker tests carry the marker ``workers``: the legs that deselect it run beside the
    chaos runs that restart the shared RabbitMQ (tests/support/matrix.py)."""
    if request.node.get_closest_marker("workers") is None:
        pytest.fail(f"{request.node.nodeid} starts worker processes: mark it `workers`")


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
        #: Put before each worker's command (``ip netns exec NAME``: a worker on another "host").
        self.prefix: list[str] = []

    def spawn(self, concurrency: int = 1) -> subprocess.Popen[bytes]:
        """Start one worker in its own session, so a kill reaches its pool children too."""
        n = next(self._names)
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"{self.queue}-{n}.log"
        self.logs.append(log)
        with log.open("wb") as handle:
            return subprocess.Popen(
                [
                    *self.prefix,
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

    def discard(self) -> None:
        """End a test's workers without waiting for a warm shutdown, and leave nothing queued.

        SIGKILL to every worker's process group (what a crash does; the test's checks are
        done by then), then the private queue is deleted and, on Redis, the messages the
        killed workers held unacknowledged are forgotten: kombu would otherwise restore
        them into the deleted queue's key once their visibility timeout passed.
        """
        for proc in self.procs:
            kill_group(proc)
        from celery import current_app

        try:
            with current_app.connection_for_write(self.broker_url) as conn:
                conn.default_channel.queue_delete(self.queue)
        except Exception:
            pass
        if self.broker_url.startswith("redis"):
            forget_unacked(self.broker_url, self.queue)

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
                    *self.prefix,
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


def forget_unacked(broker_url: str, queue: str) -> int:
    """Delete the messages of ``queue`` from kombu's Redis ``unacked`` hash and index."""
    import json

    import redis

    client = redis.Redis.from_url(broker_url, socket_timeout=5)
    tags = []
    for tag, raw in client.hscan_iter("unacked", count=1000):
        try:
            _message, _exchange, routing_key = json.loads(raw)
        except (ValueError, TypeError):
            continue
        if routing_key == queue:
            tags.append(tag)
    if tags:
        client.hdel("unacked", *tags)
        client.zrem("unacked_index", *tags)
    return len(tags)


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
