"""Run the test suite once per (virtual environment, database, order model) leg and sum the results.

Legs whose database is unreachable are reported and not run on a newcomer's
machine; with ``CI=true`` they fail the run instead.

The legs run side by side (``--jobs``, 3 by default): most of a leg's time is spent
waiting on databases, brokers and worker processes, not on the CPU. Each leg has a
database and a Redis key prefix of its own (``IO_TEST_DB_NAME`` and
``IO_TEST_NAMESPACE`` with the leg's suffix), a Redis logical database of its own while
it runs (``IO_TEST_REDIS_URL``), its own browser screenshots folder, and its output in a
log file; a failed leg's failures are printed. The long runs (marker
``heavy``) are a leg of their own; the chaos runs on RabbitMQ (marker
``restarts_rabbitmq``) run first, beside only the legs that run no worker tests and so
leave RabbitMQ alone, when they restart the shared broker (``IO_CHAOS_RESTART_RABBITMQ=1``,
as in CI). The runs that wait out a threshold (marker ``waits``) are a leg of their own
that runs beside the others, outside the count. ``--dry-run`` lists the legs (``alone``,
``beside`` the chaos runs, ``after``, ``idle``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from queue import Queue
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: tests/support/ is on the path, not the checkout
    sys.path.insert(0, str(ROOT))
from tests.support.scratch import SCRATCH  # noqa: E402

# Neither the matrix nor its legs (nor the worker processes they start) write bytecode
# into the checkout.
PYCACHE = SCRATCH / "pycache"
sys.pycache_prefix = str(PYCACHE)
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
SERVICES = {"postgres": ("127.0.0.1", 5432), "mariadb": ("127.0.0.1", 3306)}

# What the Django 6 legs repeat. Their job is the other Django and Python: the ORM,
# admin, checks, migrations and views, all of which run in-process on every database.
# What starts real Celery worker processes (marker ``workers``), whose behaviour does
# not depend on Django's version, runs in full on the Django 5.2 legs of every database;
# on Django 6 only tests/system/test_workers.py (marker ``workers_on_every_django``: the worker's
# Django integration, on both brokers) runs, on PostgreSQL. The long runs (marker
# ``heavy``: the chaos runs, a killed primary, a retry held by the broker) run on Django
# 5.2's PostgreSQL leg. The browser tests (marker ``browser``: Django's admin pages in
# Chromium, which change with Django) run on the Django 5.2 legs of PostgreSQL and
# MariaDB and on Django 6's PostgreSQL leg. The races (marker ``races``: threads and
# processes racing on the database, relays and reconcilers in parallel, the consume
# road's property runs) run the same statements the one-at-a-time tests of the same
# roads run on every leg; what they add is the database's locking and the road's logic,
# not Django's, so they run on the Django 5.2 legs of every database and not on Django 6.
# The own-model legs (tests/swapped, tests/history, tests/djshop) repeat what the
# default-model legs of the same Django and database repeat; on Django 6 they run on
# PostgreSQL only (OWN_MODEL_DATABASES). What no database or Django changes (marker
# ``same_everywhere``) runs on the first Django's SQLite leg alone (SAME_EVERYWHERE_LEG).
REPEAT = {
    "postgres": "not heavy and not races and (not workers or workers_on_every_django)",
    "mariadb": "not workers and not browser and not heavy and not races",
    "sqlite": "not workers and not races and not heavy",
}
#: Where the projects' own order models run, by the tag of the Django venv (absent: every
#: database). What an own model brings (its migrations, its ``save()``, its admin) meets
#: each database's backend on Django 5.2, and Django 6's ORM and admin on PostgreSQL.
OWN_MODEL_DATABASES = {"dj6": {"postgres"}}
#: The databases whose first-Django leg has the ``waits`` runs (their ``backends`` marker).
WAITS_DATABASES = {"sqlite"}
#: The databases whose first-Django leg runs its worker tests (marker ``workers``) as a
#: leg of their own: the rest leaves RabbitMQ alone, so it can run beside the chaos runs
#: that restart it (:func:`without_brokers`), where the places would otherwise stand idle.
WORKERS_APART_DATABASES = {"sqlite", "mariadb"}
# The long runs (marker ``heavy``): on the first Django's PostgreSQL leg they run as a
# leg of their own, beside the rest of it; the first Django's MariaDB leg runs the few
# that are MariaDB's too (the webhook load run) in line; the Django 6 legs leave them out.
HEAVY = "heavy"
RESTARTS = "restarts_rabbitmq"
HEAVY_DATABASES = {"postgres"}
#: What does not change with the database or Django (marker ``same_everywhere``: the
#: checkout's files and import graph, the matrix's plan, metrics summed across processes)
#: runs on one leg: ``(tag of the Django venv, database)``.
SAME_EVERYWHERE = "same_everywhere"
SAME_EVERYWHERE_LEG = ("", "sqlite")
#: The runs that wait out a threshold (marker ``waits``: the demo's liveness run waits a
#: minute for a killed worker to count as gone): on the first Django's legs of these
#: databases they are a leg of their own, which runs beside the others, outside the count
#: of legs at a time (it takes a place but next to no CPU).
WAITS = "waits"

# Longest first, so that the last legs to start are short ones (seconds, from runs on a
# 2-core machine; only the order matters).
ESTIMATE = {
    ("heavy", "postgres"): 225,
    ("", "postgres"): 530,
    ("", "mariadb"): 330,
    ("workers", "mariadb"): 100,
    ("", "sqlite"): 200,
    ("workers", "sqlite"): 80,
    ("dj6", "postgres"): 490,
    ("dj6", "mariadb"): 180,
    ("dj6", "sqlite"): 160,
}


# The original django-fsm leg: the app on the archived django-fsm 2.8.x (its own venv,
# make/fsm28.mk) instead of django-fsm-2, on PostgreSQL: the package check, the state graph,
# the consume road's every way through (the claim and the save() road included), batches,
# failures, and the admin's operator transitions; under a minute.
FSM28_TESTS = (
    "tests/project/test_fsm_package.py",
    "tests/project/test_checks.py",
    "tests/consume/test_graph_command.py",
    "tests/consume/test_transitions.py",
    "tests/consume/test_consume.py",
    "tests/consume/test_roads.py",
    "tests/consume/test_every_path.py",
    "tests/backends/test_postgresql_one_statement.py",
    "tests/backends/test_contract.py",
    "tests/consume/test_batch.py",
    "tests/consume/test_failures.py",
    "tests/project/test_migrations.py",
    "tests/admin/test_admin.py",
)
FSM28_SELECTION = "not workers and not heavy and not browser"
FSM28_DATABASE = "postgres"
ESTIMATE[("fsm28", FSM28_DATABASE)] = 40

#: The order models each leg runs, by the tag of their suite ("": the app's own Order)
#: and the settings that swap them in.
SUITES = (
    ("", "tests.settings"),
    ("own", "tests.settings_swapped"),
    ("history", "tests.settings_history"),
    ("djshop", "tests.settings_djshop"),
)


#: The Redis the tests use (tests/settings.py's default). Each test deletes its run's
#: fast-path keys first, with a SCAN of the whole logical database it runs in: a leg
#: running gets a database of its own from LEG_REDIS_DBS (0 is the applications' and the
#: benchmarks', 1 the worker tests' broker, 2 a plain pytest run's, 15 a check test's), so
#: that SCAN walks that leg's keys only, and the leg's keys are deleted when it ends.
REDIS_URL = os.environ.get("IO_TEST_REDIS_URL", "redis://127.0.0.1:6379/2")
LEG_REDIS_DBS = range(3, 15)
#: Keys in a leg's database that are not its own (another checkout's run, a run that was
#: killed before it deleted its keys) above which the matrix warns: every test walks them.
CROWDED_REDIS = 50_000


def redis_at(db: int) -> str:
    """REDIS_URL with logical database ``db``."""
    parts = urlsplit(REDIS_URL)
    return urlunsplit(parts._replace(path=f"/{db}"))


def redis_client(db: int) -> Any:
    import redis

    return redis.Redis.from_url(redis_at(db), socket_timeout=5)


def redis_databases() -> list[int]:
    """The legs' databases this Redis has (all of them when it does not say); [] unreachable."""
    try:
        client = redis_client(0)
        client.ping()
    except Exception:
        return []
    try:
        count = int(client.config_get("databases").get("databases", 16))
    except Exception:
        count = 16  # CONFIG is disabled on some managed Redis: the default
    return [db for db in LEG_REDIS_DBS if db < count]


def redis_keys(databases: list[int]) -> dict[int, int]:
    """How many keys each database holds (those that cannot be asked left out)."""
    counts = {}
    for db in databases:
        with contextlib.suppress(Exception):
            counts[db] = int(redis_client(db).dbsize())
    return counts


def delete_redis_keys(db: int, namespace: str) -> None:
    """Delete the keys under a leg's KEY_PREFIX (``namespace:``) in its database."""
    try:
        client = redis_client(db)
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{namespace}:*", count=10_000):
            batch.append(key)
            if len(batch) >= 5_000:
                client.delete(*batch)
                batch.clear()
        if batch:
            client.delete(*batch)
    except Exception as exc:
        print(f"matrix: could not delete the Redis keys {namespace}:* in database {db}: {exc}")


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def why_not(python: Path, database: str) -> str | None:
    if not python.exists():
        return f"{python} does not exist"
    if database in SERVICES and not reachable(*SERVICES[database]):
        return f"{database} is not reachable at {':'.join(map(str, SERVICES[database]))}"
    if database == "mariadb":
        probe = subprocess.run([python, "-c", "import MySQLdb"], capture_output=True)
        if probe.returncode:
            return "mysqlclient is not installed (needs libmariadb-dev and pkg-config)"
    return None


@dataclass
class Leg:
    name: str
    key: str  # a file name: the leg's log, junit report and screenshots folder
    python: Path
    database: str
    settings_module: str
    selection: str
    suffix: str  # appended to the database name and the Redis key prefix
    estimate: float
    exclusive: bool = False
    #: Waits more than it works (marker ``waits``): runs outside the count of legs at a time.
    idle: bool = False
    paths: tuple[str, ...] = ()  # test files (none: the whole suite)
    env: tuple[tuple[str, str], ...] = ()  # more environment for the leg


def split_off(leg: Leg, marks: str, tail: str, **changes: Any) -> Leg:
    """A leg of its own for the runs of ``leg`` that ``marks`` selects (its log, database
    and Redis prefix named with ``tail``)."""
    return replace(
        leg,
        name=f"{leg.name} | -m '{marks}'",
        key=f"{leg.key}-{tail}",
        selection=marks,
        suffix=f"{leg.suffix}_{tail.replace('-', '_')}",
        **changes,
    )


@dataclass
class Result:
    leg: Leg
    returncode: int
    counts: dict[str, int]
    seconds: float
    log: Path


def minutes(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60} s"


def summary_of(log: Path, lines: int = 400) -> str:
    """What a failed leg said: pytest's ERRORS/FAILURES sections on, or the log's last lines."""
    text = log.read_text(errors="replace") if log.exists() else ""
    starts = [m.start() for m in re.finditer(r"^=+ (ERRORS|FAILURES) =+$", text, re.MULTILINE)]
    if starts:
        text = text[min(starts) :]
    kept = text.splitlines()
    if len(kept) > lines:
        kept = [
            *kept[: lines // 2],
            f"[... {len(kept) - lines} lines: see {log}]",
            *kept[-lines // 2 :],
        ]
    return "\n".join(kept)


def run_leg(
    leg: Leg,
    pytest_args: list[str],
    report_dir: Path,
    base: dict[str, str],
    redis_dbs: Queue[int] | None,
) -> Result:
    # The legs running at once never outnumber the databases (see main); a database
    # is another leg's only after this leg's keys are deleted from it.
    db = redis_dbs.get() if redis_dbs is not None else None
    try:
        return run_leg_in(leg, pytest_args, report_dir, base, db)
    finally:
        if db is not None and redis_dbs is not None:
            delete_redis_keys(db, base["namespace"] + leg.suffix)
            redis_dbs.put(db)


def run_leg_in(
    leg: Leg, pytest_args: list[str], report_dir: Path, base: dict[str, str], db: int | None
) -> Result:
    junit = report_dir / f"{leg.key}.xml"
    log = report_dir / f"{leg.key}.log"
    junit.unlink(missing_ok=True)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": leg.settings_module,
        "IO_TEST_DATABASE": leg.database,
        "IO_TEST_DB_NAME": base["db"] + leg.suffix,
        "IO_TEST_NAMESPACE": base["namespace"] + leg.suffix,
        **({"IO_TEST_REDIS_URL": redis_at(db)} if db is not None else {}),
        "IO_TEST_SCREENSHOTS": str(report_dir / "screenshots" / leg.key),
        "IO_TEST_SCRATCH": str(SCRATCH),
        "PYTHONPYCACHEPREFIX": str(PYCACHE),
        **dict(leg.env),
    }
    print(f"=== leg {leg.name}: started", flush=True)
    started = time.monotonic()
    with log.open("wb") as out:
        result = subprocess.run(
            [
                leg.python,
                "-m",
                "pytest",
                # Legs run side by side: none of them writes pytest's cache in the checkout.
                "-p",
                "no:cacheprovider",
                f"--junitxml={junit}",
                *(["-m", leg.selection] if leg.selection else []),
                *pytest_args,
                *leg.paths,
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    seconds = time.monotonic() - started
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if junit.exists():
        for test_suite in ET.parse(junit).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(test_suite.get(key, 0))
    failed = counts["failures"] + counts["errors"]
    print(
        f"=== leg {leg.name}: exit {result.returncode}, {counts['tests']} tests, "
        f"{failed} failed, {counts['skipped']} skipped, {minutes(seconds)} (log: {log})",
        flush=True,
    )
    if result.returncode != 0 or counts["tests"] == 0:
        print(summary_of(log), flush=True)
    return Result(leg, result.returncode, counts, seconds, log)


def without_brokers(leg: Leg) -> bool:
    """Whether a leg leaves RabbitMQ alone: it runs no worker tests (marker ``workers``).

    Every test that talks to RabbitMQ starts workers or batch consumers on it
    (tests/conftest.py refuses the ``celery_workers`` fixture to a test without the
    marker); the other tests publish to the in-memory broker.
    """
    if leg.exclusive or not leg.selection:
        return False
    from itertools import combinations

    from _pytest.mark.expression import Expression

    selected = Expression.compile(leg.selection)
    others = (
        "workers_on_every_django",
        HEAVY,
        RESTARTS,
        WAITS,
        "races",
        "browser",
        "slow",
        "services",
    )
    marked = [
        {"workers", *more} for size in range(len(others) + 1) for more in combinations(others, size)
    ]
    return not any(selected.evaluate(_marked_with(markers)) for markers in marked)


def _marked_with(markers: set[str]) -> Callable[..., bool]:
    return lambda name, **_: name in markers


def schedule(legs: list[Leg], jobs: int, run: Callable[[Leg], Result]) -> list[Result]:
    """Run the legs, ``jobs`` at a time, longest first; the exclusive legs one after another.

    While the exclusive legs run (the chaos runs that restart the shared RabbitMQ), the
    other places run only legs that leave RabbitMQ alone (:func:`without_brokers`); the
    rest start once the exclusive legs are done.
    """
    alone = [leg for leg in legs if leg.exclusive]
    idle = [leg for leg in legs if leg.idle and not leg.exclusive]
    waiting = sorted(
        (leg for leg in legs if not leg.exclusive and not leg.idle), key=lambda leg: -leg.estimate
    )
    lock = threading.Lock()
    alone_done = threading.Event()
    if not alone:
        alone_done.set()
    results: list[Result] = []

    def place(first: list[Leg]) -> None:
        for leg in first:
            results.append(run(leg))
        if first:
            alone_done.set()
        while True:
            with lock:
                free = alone_done.is_set()
                leg = next((leg for leg in waiting if free or without_brokers(leg)), None)
                if leg is not None:
                    waiting.remove(leg)
                elif not waiting:
                    return
            if leg is None:
                alone_done.wait()
                continue
            results.append(run(leg))

    def beside(leg: Leg) -> None:
        # From the start, even beside the chaos runs: a run that waits (marker ``waits``)
        # starts its workers on the demo's embedded broker, never on the shared RabbitMQ.
        results.append(run(leg))

    with ThreadPoolExecutor(max_workers=jobs + len(idle)) as pool:
        places = [pool.submit(place, alone if n == 0 else []) for n in range(jobs)]
        places += [pool.submit(beside, leg) for leg in idle]
        for done in places:
            done.result()
    return results


def main() -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser()
    parser.add_argument("--venv", default=".venv")
    parser.add_argument("--venv-dj6", default=None)
    parser.add_argument(
        "--venv-fsm28",
        default=None,
        help="a venv with the original django-fsm 2.8.x instead of django-fsm-2 (one leg)",
    )
    parser.add_argument("--databases", default="sqlite,postgres,mariadb")
    parser.add_argument(
        "--jobs",
        type=int,
        default=int(os.environ.get("IO_TEST_JOBS", "3")),
        help="legs run at once (IO_TEST_JOBS; 1 runs them one after another)",
    )
    parser.add_argument("--dry-run", action="store_true", help="list the legs, run nothing")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()

    databases = args.databases.split(",")
    venvs = [(args.venv, "", None)]  # (venv, tag for names, what the legs repeat)
    if args.venv_dj6:
        venvs.append((args.venv_dj6, "dj6", REPEAT))
    elif IN_CI:
        print("matrix: no Python >= 3.12 for the Django 6 leg (required in CI)")
        return 1

    base_db = os.environ.get("IO_TEST_DB_NAME", "test_io")
    base = {"db": base_db, "namespace": os.environ.get("IO_TEST_NAMESPACE", base_db)}
    restarts_rabbitmq = os.environ.get("IO_CHAOS_RESTART_RABBITMQ") == "1"
    problems: list[str] = []
    legs: list[Leg] = []
    for venv, tag, repeat in venvs:
        python = ROOT / venv / "bin" / "python"
        version = (
            subprocess.run(
                [
                    python,
                    "-c",
                    "import django, sys; print(f'Django {django.__version__}, "
                    "Python {sys.version.split()[0]}')",
                ],
                capture_output=True,
                text=True,
            ).stdout.strip()
            if python.exists()
            else "?"
        )
        for database in databases:
            title = f"{database} | {version}"
            reason = why_not(python, database)
            if reason:
                message = f"leg {title}: not run: {reason}"
                print(f"=== {message}", flush=True)
                problems.append(message)
                continue
            selection = repeat.get(database, "") if repeat is not None else ""
            # Each leg runs the default order model, then the projects' own models
            # swapped in, each in its own process (the model is chosen once per
            # process, like the user model): tests/swapped, tests/history (save()
            # with history and audit packages), tests/djshop (django-SHOP's workflow).
            for model, settings_module in SUITES:
                own = model != ""
                if own and database not in OWN_MODEL_DATABASES.get(tag, {database}):
                    continue
                suffix = f"_{database}{'_' + tag if tag else ''}{'_' + model if own else ''}"
                name = f"{title}{f' | order model: {model}' if own else ''}"
                leg = Leg(
                    name=name,
                    key=f"{Path(venv).name.lstrip('.')}-{database}{'-' + model if own else ''}",
                    python=python,
                    database=database,
                    settings_module=settings_module,
                    selection=selection,
                    suffix=suffix,
                    estimate=ESTIMATE.get((tag, database), 60) * (0.15 if own else 1),
                )
                selection_here = selection
                if not own and (tag, database) != SAME_EVERYWHERE_LEG:
                    selection_here = " and ".join(
                        part for part in (f"not {SAME_EVERYWHERE}", selection) if part
                    )
                if not own and not selection and database in WAITS_DATABASES:
                    legs.append(split_off(leg, WAITS, "waits", estimate=0, idle=True))
                    selection_here = " and ".join(
                        part for part in (f"not {WAITS}", selection_here) if part
                    )
                if not own and not selection and database in WORKERS_APART_DATABASES:
                    estimate = ESTIMATE[("workers", database)]
                    marks = "workers" + (f" and not {WAITS}" if database in WAITS_DATABASES else "")
                    legs.append(split_off(leg, marks, "workers", estimate=estimate))
                    selection_here = " and ".join(
                        part for part in ("not workers", selection_here) if part
                    )
                split = not own and not selection and database in HEAVY_DATABASES
                if split:
                    # The chaos runs on RabbitMQ restart the shared broker when asked
                    # (IO_CHAOS_RESTART_RABBITMQ=1, CI): then they are a leg of their own
                    # that runs alone, before the others.
                    heavy_legs = (
                        [
                            (f"{HEAVY} and {RESTARTS}", "-alone", True),
                            (f"{HEAVY} and not {RESTARTS}", "", False),
                        ]
                        if restarts_rabbitmq
                        else [(HEAVY, "", False)]
                    )
                    for heavy, tail, alone in heavy_legs:
                        estimate = ESTIMATE[("heavy", database)]
                        legs.append(
                            split_off(
                                leg, heavy, f"heavy{tail}", estimate=estimate, exclusive=alone
                            )
                        )
                    selection_here = " and ".join(
                        part for part in (f"not {HEAVY}", selection_here) if part
                    )
                legs.append(
                    replace(
                        leg,
                        name=name + (f" | -m '{selection_here}'" if selection_here else ""),
                        selection=selection_here,
                    )
                )

    if args.venv_fsm28:
        python = ROOT / args.venv_fsm28 / "bin" / "python"
        title = f"{FSM28_DATABASE} | django-fsm 2.8.x | {len(FSM28_TESTS)} files"
        reason = why_not(python, FSM28_DATABASE)
        if reason:
            message = f"leg {title}: not run: {reason}"
            print(f"=== {message}", flush=True)
            problems.append(message)
        else:
            legs.append(
                Leg(
                    name=f"{title} | -m '{FSM28_SELECTION}'",
                    key=f"{Path(args.venv_fsm28).name.lstrip('.')}-{FSM28_DATABASE}",
                    python=python,
                    database=FSM28_DATABASE,
                    settings_module="tests.settings",
                    selection=FSM28_SELECTION,
                    suffix=f"_{FSM28_DATABASE}_fsm28",
                    estimate=ESTIMATE[("fsm28", FSM28_DATABASE)],
                    paths=FSM28_TESTS,
                    env=(("IO_TEST_DJANGO_FSM", "django-fsm==2.8"),),
                )
            )

    jobs = max(1, args.jobs)
    databases = redis_databases()
    redis_dbs: Queue[int] | None = None
    if databases:
        # One database per leg running: more jobs than databases would share them.
        jobs = min(jobs, len(databases))
        redis_dbs = Queue()
        for db in databases:
            redis_dbs.put(db)
    for db, count in redis_keys(databases).items():
        if count > CROWDED_REDIS:
            # Each test clears its own keys with a SCAN of its leg's whole database: other
            # keys there slow every test of the leg down (seen in one database: 14 -> 40 min).
            print(
                f"matrix: warning: Redis database {db} at {redis_at(db)} holds {count:,} "
                "keys; each test of the leg that runs there scans them all, so it runs "
                "slower (delete the keys other runs left there)",
                flush=True,
            )
    if args.dry_run:
        chaos_first = any(leg.exclusive for leg in legs)
        for leg in sorted(legs, key=lambda leg: (not leg.exclusive, -leg.estimate)):
            when = (
                "alone"
                if leg.exclusive
                else "idle"
                if leg.idle
                else "beside"
                if chaos_first and without_brokers(leg)
                else "after"
                if chaos_first
                else ""
            )
            print(
                f"{when:>6}  {leg.name}  "
                f"(IO_TEST_DB_NAME={base['db']}{leg.suffix}, {leg.settings_module})"
            )
        return 0
    report_dir = SCRATCH / "matrix"
    report_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"matrix: {len(legs)} legs, {jobs} at a time; logs and junit reports in {report_dir}",
        flush=True,
    )
    results = schedule(
        legs, jobs, lambda leg: run_leg(leg, args.pytest_args, report_dir, base, redis_dbs)
    )

    totals = {"passed": 0, "failed": 0, "skipped": 0}
    print("\nmatrix legs:")
    for result in sorted(results, key=lambda r: legs.index(r.leg)):
        counts = result.counts
        failed = counts["failures"] + counts["errors"]
        totals["failed"] += failed
        totals["skipped"] += counts["skipped"]
        totals["passed"] += counts["tests"] - failed - counts["skipped"]
        print(
            f"  {minutes(result.seconds):>13}  exit {result.returncode}  "
            f"{counts['tests']:4d} tests {failed:3d} failed {counts['skipped']:4d} skipped  "
            f"{result.leg.name}"
        )
        if result.returncode != 0 or counts["tests"] == 0:
            problems.append(f"leg {result.leg.name}: pytest exit {result.returncode}")

    print()
    for problem in problems:
        print(f"matrix problem: {problem}")
    ok = not problems or (
        not IN_CI and totals["failed"] == 0 and all("not run" in p for p in problems)
    )
    print(
        f"matrix: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped"
    )
    print(f"make test took {minutes(time.monotonic() - started)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
