"""Section 8: scale-out, 1 to N Celery worker processes against one PostgreSQL.

A fixed load of ``consume_payment`` messages (``BENCH_SCALE_MESSAGES``) is
published to a RabbitMQ queue before any worker starts; then ``k`` worker
processes (one pool child each) consume it, for each ``k`` in
``BENCH_SCALE_WORKERS`` (1,2,4; add more, ``1,2,4,8``, to go further). The
rate is taken from the moment the last of the ``k`` workers subscribed to the
moment every message has its inbox row, so start-up does not count against the
larger runs.

Each rate is set beside pgbench's write ceiling on the same box, measured in
the same run with the same number of clients: ``pgbench -i`` on a scratch
database of its own, then ``BENCH_SCALE_PGBENCH_SECONDS`` (5) of a custom script
making one INSERT and one UPDATE per transaction, what a payment costs the
database at least (the inbox row, the order's conditional UPDATE).
``python -m bench scale_out --chart`` also draws the curve into
``docs/img/scale_out.png``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import ROOT, Row, fmt, make_orders, na, payment, setup

SECTION = "8 scale-out"
N = int(os.environ.get("BENCH_SCALE_MESSAGES", "2000"))
WORKERS = [int(w) for w in os.environ.get("BENCH_SCALE_WORKERS", "1,2,4").split(",") if w]
PGBENCH_SECONDS = int(os.environ.get("BENCH_SCALE_PGBENCH_SECONDS", "5"))
SCRATCH_DB = os.environ.get("BENCH_SCALE_PGBENCH_DB", "bench_scale_pgbench")
CHART = ROOT / "docs" / "img" / "scale_out.png"

#: One INSERT and one UPDATE per transaction (the pgbench tables, scale 1).
SCRIPT = """\
\\set aid random(1, 100000 * :scale)
\\set delta random(-5000, 5000)
BEGIN;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (1, 1, :aid, :delta, CURRENT_TIMESTAMP);
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
END;
"""


def pgbench_program(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for base in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (base / name).exists():
            return str(base / name)
    return None


def _pg_args() -> tuple[list[str], dict[str, str]]:
    from django.conf import settings

    db = settings.DATABASES["default"]
    args = ["-h", db["HOST"] or "127.0.0.1", "-p", str(db["PORT"] or 5432), "-U", db["USER"]]
    env = {**os.environ}
    if db["PASSWORD"]:
        env["PGPASSWORD"] = db["PASSWORD"]
    return args, env


def pgbench_init() -> None:
    """A scratch database of pgbench's own, initialised at scale 1."""
    import psycopg
    from django.conf import settings

    db = settings.DATABASES["default"]
    with psycopg.connect(
        host=db["HOST"] or None,
        port=db["PORT"] or None,
        user=db["USER"] or None,
        password=db["PASSWORD"] or None,
        dbname="postgres",
        autocommit=True,
    ) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{SCRATCH_DB}"')
        admin.execute(f'CREATE DATABASE "{SCRATCH_DB}"')
    program = pgbench_program("pgbench")
    assert program is not None
    args, env = _pg_args()
    subprocess.run(
        [program, "-i", "-q", "-s", "1", *args, SCRATCH_DB],
        check=True,
        capture_output=True,
        env=env,
        timeout=120,
    )


def pgbench_tps(clients: int) -> float:
    """Transactions per second of the INSERT + UPDATE script with ``clients`` clients."""
    program = pgbench_program("pgbench")
    assert program is not None
    args, env = _pg_args()
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
        script.write(SCRIPT)
    try:
        done = subprocess.run(
            [
                program,
                "-n",
                "-f",
                script.name,
                "-c",
                str(clients),
                "-j",
                str(clients),
                "-T",
                str(PGBENCH_SECONDS),
                *args,
                SCRATCH_DB,
            ],
            check=True,
            capture_output=True,
            text=True,
            env=env,
            timeout=PGBENCH_SECONDS + 60,
        )
    finally:
        os.unlink(script.name)
    match = re.search(r"tps = ([0-9.]+) \(without initial connection", done.stdout)
    if match is None:
        match = re.search(r"tps = ([0-9.]+)", done.stdout)
    assert match is not None, done.stdout
    return float(match.group(1))


def _consumers(queue: str) -> int:
    from celery import current_app

    with current_app.connection_for_write() as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).consumer_count)


def _wait(predicate, timeout: float, interval: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the workers did not finish in time")
        time.sleep(interval)


def consume_rate(url: str, processes: int) -> float:
    """Messages per second of ``processes`` workers on a queue loaded before they start."""
    from celery import current_app

    from idempotent_orders.models import ProcessedMessage
    from idempotent_orders.tasks import consume_payment
    from tests.support.services import Workers, worker_env

    queue = f"bench-scale-{processes}-{uuid.uuid4().hex[:8]}"
    env = worker_env(broker_url=url, queue=queue, settings_module="bench.settings")
    current_app.conf.broker_url = url
    current_app.conf.task_default_queue = queue
    tag = f"{queue}-"
    orders = make_orders(N)
    with current_app.connection_for_write() as conn:
        current_app.amqp.queues[queue].bind(conn.default_channel).declare()
        for o in orders:
            m = payment(o, tag)
            consume_payment.apply_async(
                args=[m], task_id=m["message_id"], connection=conn, queue=queue
            )
    rows = ProcessedMessage.objects.filter(message_id__startswith=f"pay-{tag}")
    workers = Workers(url, queue, env)
    try:
        workers.start(processes, 1)
        _wait(lambda: _consumers(queue) >= processes, 120, 0.01)
        start = time.perf_counter()
        done_before = rows.count()
        if done_before > N // 2:
            raise RuntimeError(f"{done_before} of {N} consumed before the last worker came up")
        _wait(lambda: rows.count() >= N, 300, 0.05)
        elapsed = time.perf_counter() - start
    finally:
        workers.stop()
        with current_app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
    return (N - done_before) / elapsed


def run() -> list[Row]:
    setup()
    from tests.support.services import BROKERS, service_reachable

    url = BROKERS["rabbitmq"]()
    if not service_reachable(url):
        return [na(SECTION, "rabbitmq", f"rabbitmq not reachable at {url}")]
    if pgbench_program("pgbench") is None:
        return [na(SECTION, "pgbench", "pgbench not found (postgresql-client or server bin)")]
    rows = []
    first: float | None = None
    try:
        pgbench_init()
        for processes in WORKERS:
            ceiling = pgbench_tps(processes)
            rate = consume_rate(url, processes)
            first = first or rate
            speed_up = f"; {rate / first:.2f}x {WORKERS[0]} proc" if rate is not first else ""
            rows.append(
                Row(
                    SECTION,
                    f"{processes} worker proc, {N:,} msgs pre-published: consume_payment",
                    fmt(rate),
                    f"{rate / ceiling:.1%} of pgbench INSERT+UPDATE, {processes} clients "
                    f"({fmt(ceiling, ' tps')}){speed_up}",
                    figure=rate,
                    baseline=ceiling,
                    baseline_what=f"pgbench INSERT+UPDATE, {processes} clients",
                )
            )
    except Exception as exc:
        rows.append(na(SECTION, "scale-out", repr(exc)[:100]))
    finally:
        _drop_scratch()
    return rows


def _drop_scratch() -> None:
    import psycopg
    from django.conf import settings

    db = settings.DATABASES["default"]
    try:
        with psycopg.connect(
            host=db["HOST"] or None,
            port=db["PORT"] or None,
            user=db["USER"] or None,
            password=db["PASSWORD"] or None,
            dbname="postgres",
            autocommit=True,
        ) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{SCRATCH_DB}"')
    except Exception:
        pass


def chart(rows: list[Row], title: str, path: Path = CHART) -> Path | None:
    """The curve: each worker count's rate as a share of pgbench with as many clients,
    and beside it both speed-ups over the smallest count."""
    points = sorted(
        (int(r.what.split()[0]), r.figure, r.baseline)
        for r in rows
        if r.section == SECTION and r.figure is not None and r.baseline
    )
    if not points:
        return None
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p[0] for p in points]
    share = [p[1] / p[2] * 100 for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(xs, share, marker="o", color="#1565c0")
    for x, y in zip(xs, share, strict=True):
        left.annotate(f"{y:.0f}%", (x, y), textcoords="offset points", xytext=(0, 7), ha="center")
    left.set_ylabel("consume_payment, % of pgbench tps\n(INSERT+UPDATE, as many clients)")
    left.set_ylim(0, max(share) * 1.3)
    right.plot(xs, [p[1] / points[0][1] for p in points], marker="o", color="#1565c0")
    right.plot(xs, [p[2] / points[0][2] for p in points], marker="s", color="#9e9e9e")
    right.plot(xs, [x / xs[0] for x in xs], linestyle=":", color="#bdbdbd")
    right.legend(["consume_payment", "pgbench", "linear"], fontsize=8)
    right.set_ylabel(f"speed-up over {xs[0]} process / client")
    for ax in (left, right):
        ax.set_xticks(xs)
        ax.set_xlabel("Celery worker processes (one pool child each) / pgbench clients")
        ax.grid(alpha=0.3)
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    import sys

    from bench.common import print_table

    found = run()
    print_table(found)
    if "--chart" in sys.argv:
        print(f"chart: {chart(found, 'scale-out: consume_payment as a share of pgbench')}")
