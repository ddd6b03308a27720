"""The chaos run with the workers on another "host": a network namespace of their own.

The workers reach PostgreSQL, the broker and Redis only through a fault proxy
on the host end of a veth pair (tests/support/netns.py): every forwarded chunk
is delayed, some connections are aborted and new ones refused, and the link is
cut for a few seconds (a partition), while the suite's SIGKILLs, broker
restart, FLUSHALL and ``pg_terminate_backend`` go on as in test_chaos.py. The
verdict is the suite's: 0 lost and 0 applied twice, read from the database.
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Iterator

import pytest
from celery import current_app
from django.conf import settings

from tests.reliability.test_chaos import (  # noqa: F401
    BOUNDED,
    chaos_broker,
    private_redis,
    use_broker,
)
from tests.support.chaos import build_stream, make_orders, run_chaos
from tests.support.netns import (
    PREFIX,
    FaultProxy,
    Namespace,
    NetworkChaosContext,
    link_exists,
    namespace_exists,
    network_namespace,
    remove_stale,
    require_namespaces,
)
from tests.support.services import (
    RedisServer,
    Workers,
    worker_env,
)

pytestmark = [
    pytest.mark.backends("postgresql"),
    pytest.mark.workers,
    pytest.mark.heavy,
    pytest.mark.services,
]

#: Broker-wiping faults first (as in test_chaos.py), then the network faults among the kills.
SCHEDULE = (
    "restart_broker",
    "flush_redis",
    "kill_worker",
    "drop_connections",
    "terminate_db",
    "kill_worker",
    "partition",
    "kill_worker",
    "drop_connections",
    "kill_worker",
    "kill_worker",
)
#: Every forwarded chunk waits 1-10 ms: a slow link between the "hosts".
DELAY = (0.001, 0.010)


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    with network_namespace() as ns:
        yield ns
    assert not namespace_exists(ns.name), f"namespace {ns.name} left behind"
    assert not link_exists(ns.host_if), f"veth {ns.host_if} left behind"


@pytest.fixture
def proxy(namespace: Namespace) -> Iterator[FaultProxy]:
    fault_proxy = FaultProxy(namespace.host_ip, delay=DELAY)
    fault_proxy.start()
    yield fault_proxy
    fault_proxy.stop()


def _hostport(url: str, default: int) -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default


def _through(url: str, proxy: FaultProxy, default: int) -> str:
    """``url`` with its host and port replaced by a new port of the proxy in front of it."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    port = proxy.forward(*_hostport(url, default))
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=f"{auth}{proxy.listen_host}:{port}"))


def test_proxy_delays_drops_and_partitions(namespace: Namespace, proxy: FaultProxy) -> None:
    """The faults act: a worker-side client sees the delay, the abort, the refusal and the cut."""
    import subprocess
    import sys

    port = proxy.forward(*_hostport(settings.REDIS_URL, 6379))
    client = [
        *namespace.prefix(),
        sys.executable,
        "-c",
        "import redis, sys; from redis.backoff import NoBackoff; from redis.retry import Retry; "
        "r = redis.Redis(host=sys.argv[1], port=int(sys.argv[2]), socket_timeout=1, "
        "socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)); print(r.ping())",
        namespace.host_ip,
        str(port),
    ]

    def ping() -> str:
        done = subprocess.run(client, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() or done.stderr.strip().splitlines()[-1]

    assert ping() == "True"
    assert proxy.counts["delayed chunks"] > 0
    proxy.refuse = 1
    assert ping() != "True"
    assert proxy.counts["refused"] == 1
    assert ping() == "True"
    namespace.link(False)
    try:
        assert ping() != "True"
    finally:
        namespace.link(True)
    assert ping() == "True"


@pytest.mark.parametrize(
    "broker", ["redis", pytest.param("rabbitmq", marks=pytest.mark.restarts_rabbitmq)]
)
def test_exactly_once_across_network_namespaces(
    broker: str,
    transactional_db: None,
    private_redis: RedisServer,  # noqa: F811
    use_broker: None,  # noqa: F811
    namespace: Namespace,
    proxy: FaultProxy,
) -> None:
    from django.db import connection

    seed = int(os.environ.get("IO_CHAOS_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    queue = f"io-chaos-ns-{uuid.uuid4().hex[:10]}"
    broker_url, restart = chaos_broker(broker, private_redis, queue)

    db = connection.settings_dict
    database_url = f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/x"
    env = worker_env(
        broker_url=_through(broker_url, proxy, 5672 if broker == "rabbitmq" else 6379),
        queue=queue,
        settings_module="tests.chaos_settings",
        IO_TEST_REDIS_URL=_through(private_redis.db_url(1), proxy, 6379),
        IO_TEST_POSTGRES_URL=_through(database_url, proxy, 5432),
    )
    if db["PASSWORD"]:
        env["PGPASSWORD"] = db["PASSWORD"]
    orders = make_orders(BOUNDED.orders)
    stream = build_stream(orders, rng=rng, max_copies=BOUNDED.max_copies)
    workers = Workers(broker_url=broker_url, queue=queue, env=env)
    workers.prefix = namespace.prefix()
    workers.start(BOUNDED.workers)
    ctx = NetworkChaosContext(
        workers=workers,
        rng=rng,
        restart_broker=restart,
        flush_redis=private_redis.flushall,
        namespace=namespace,
        proxy=proxy,
    )
    try:
        report = run_chaos(stream, ctx, broker=broker, schedule=SCHEDULE, settle_timeout=60)
    finally:
        workers.stop()
        if broker == "rabbitmq":
            try:
                with current_app.connection_for_write() as conn:
                    conn.default_channel.queue_delete(queue)
            except Exception:
                pass
    counts = ", ".join(f"{k}={v}" for k, v in sorted(proxy.counts.items()))
    summary = (
        f"workers in {namespace.name} seed={seed} {report.summary()}; proxy: {counts}; "
        f"faults: {'; '.join(report.faults)}"
    )
    print(summary)
    assert not report.invariants.violations, (
        summary + "\n" + "\n".join(report.invariants.violations) + "\n" + workers.log_tail()
    )
    # The faults happened, and through the namespace: the workers used the proxy.
    assert sum(1 for f in report.faults if f.startswith("SIGKILL")) >= 5
    assert ctx.terminated > 0, "the database fault hit no worker connection"
    assert ctx.dropped > 0, "the proxy aborted no connection"
    assert namespace.partitions == 1
    assert proxy.counts["delayed chunks"] > 0


def test_namespace_removed_when_the_run_fails() -> None:
    seen: list[Namespace] = []

    def failing_run() -> None:
        with network_namespace() as ns:
            seen.append(ns)
            assert namespace_exists(ns.name)
            assert link_exists(ns.host_if)
            raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError, match="the run failed"):
        failing_run()
    (ns,) = seen
    assert not namespace_exists(ns.name)
    assert not link_exists(ns.host_if)


def test_namespace_of_a_killed_run_removed_by_the_next() -> None:
    import subprocess

    require_namespaces()
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{PREFIX}{dead.pid}-dead"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in remove_stale()
        assert not namespace_exists(name)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
