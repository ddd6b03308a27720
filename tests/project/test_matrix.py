"""The test matrix's scheduling (tests/support/matrix.py): which legs run beside the chaos runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from tests.support import matrix

pytestmark = pytest.mark.same_everywhere


def leg(name: str, selection: str, estimate: float = 1, exclusive: bool = False) -> matrix.Leg:
    return matrix.Leg(
        name=name,
        key=name,
        python=Path("python"),
        database="postgres",
        settings_module="tests.settings",
        selection=selection,
        suffix="",
        estimate=estimate,
        exclusive=exclusive,
    )


def test_only_legs_that_deselect_every_worker_test_leave_rabbitmq_alone() -> None:
    assert matrix.without_brokers(leg("m", matrix.REPEAT["mariadb"]))
    assert matrix.without_brokers(leg("s", matrix.REPEAT["sqlite"]))
    assert matrix.without_brokers(leg("f", matrix.FSM28_SELECTION))
    # The demo's liveness run starts workers (on the demo's own broker): not a quiet leg.
    assert not matrix.without_brokers(leg("w", matrix.WAITS))
    assert matrix.without_brokers(leg("s-w", f"{matrix.REPEAT['sqlite']} and not {matrix.WAITS}"))
    # Django 6's PostgreSQL leg still runs the workers marked workers_on_every_django.
    assert not matrix.without_brokers(leg("p", matrix.REPEAT["postgres"]))
    assert not matrix.without_brokers(leg("all", ""))
    assert not matrix.without_brokers(leg("rest", f"not {matrix.HEAVY}"))
    assert not matrix.without_brokers(leg("chaos", matrix.HEAVY, exclusive=True))


def test_while_the_chaos_runs_restart_rabbitmq_only_legs_without_workers_run() -> None:
    chaos_done = threading.Event()
    after_chaos: dict[str, bool] = {}

    def run(one: matrix.Leg) -> matrix.Result:
        after_chaos[one.name] = chaos_done.is_set()
        time.sleep(1.0 if one.exclusive else 0.05)
        if one.exclusive:
            chaos_done.set()
        return matrix.Result(one, 0, {}, 0.0, Path("log"))

    legs = [
        leg("workers", "not heavy", estimate=100),
        leg("quiet-1", matrix.REPEAT["mariadb"], estimate=50),
        leg("quiet-2", matrix.REPEAT["sqlite"], estimate=40),
        leg("chaos", matrix.HEAVY, exclusive=True),
        leg("workers-2", "", estimate=10),
    ]
    results = matrix.schedule(legs, 3, run)

    assert sorted(result.leg.name for result in results) == sorted(one.name for one in legs)
    # The legs without worker tests ran beside the chaos run; the others waited for it.
    assert after_chaos == {
        "chaos": False,
        "quiet-1": False,
        "quiet-2": False,
        "workers": True,
        "workers-2": True,
    }


def test_a_leg_that_waits_runs_beside_the_others_outside_the_count() -> None:
    started: dict[str, float] = {}

    def run(one: matrix.Leg) -> matrix.Result:
        started[one.name] = time.monotonic()
        time.sleep(0.3)
        return matrix.Result(one, 0, {}, 0.0, Path("log"))

    waits = leg("waits", matrix.WAITS)
    waits.idle = True
    legs = [leg("first", "not heavy", estimate=10), leg("second", "", estimate=5), waits]
    began = time.monotonic()
    results = matrix.schedule(legs, 1, run)

    assert sorted(result.leg.name for result in results) == ["first", "second", "waits"]
    # One place: "second" waits for "first"; the idle leg starts beside "first".
    assert started["second"] - began >= 0.3
    assert started["waits"] - began < 0.2


#: The matrix's plan of a CI run, printed without running it (every database taken as
#: reachable: the plan does not depend on what this machine runs).
PLAN = """
import sys
from tests.support import matrix
matrix.why_not = lambda python, database: None
sys.argv = ["matrix.py", "--venv", sys.prefix, "--venv-dj6", sys.prefix, "--dry-run"]
sys.exit(matrix.main())
"""


def ci_plan() -> subprocess.CompletedProcess[str]:
    """What ``make test`` runs in CI (``CI=true``, the chaos runs apart), as planned."""
    done = subprocess.run(
        [sys.executable, "-c", PLAN],
        cwd=matrix.ROOT,
        env={**os.environ, "CI": "true", "IO_CHAOS_RESTART_RABBITMQ": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_what_is_the_same_everywhere_runs_on_one_leg_of_the_suite() -> None:
    done = ci_plan()
    legs = re.findall(
        r"^\s*\w*\s+(\w+) \| Django .*?(?:-m '([^']*)')?\s+\(IO_TEST_DB_NAME=(\S+), ([\w.]+)\)$",
        done.stdout,
        re.M,
    )
    # The whole suite's legs (not the own models'): 3 databases, 2 Djangos, the splits.
    whole = [
        (db, name, marks) for db, marks, name, settings in legs if settings == "tests.settings"
    ]
    assert len(whole) >= 6, done.stdout
    running = [
        (db, name)
        for db, name, marks in whole
        if not marks
        or Expression.compile(marks).evaluate(lambda mark, **_: mark == matrix.SAME_EVERYWHERE)
    ]
    base = os.environ.get("IO_TEST_DB_NAME", "test_io")
    assert running == [("sqlite", f"{base}_sqlite")]


def test_beside_the_chaos_runs_every_place_has_a_leg_that_leaves_rabbitmq_alone() -> None:
    done = ci_plan()
    beside = re.findall(r"^beside  (.*?)  \(IO_TEST_DB_NAME=(\S+),", done.stdout, re.M)
    base = os.environ.get("IO_TEST_DB_NAME", "test_io")
    # The first Django's SQLite and MariaDB legs run their worker tests apart (after the
    # chaos runs), and the rest beside them, with Django 6's SQLite and MariaDB legs.
    for database in ("sqlite", "mariadb"):
        assert f"{base}_{database}" in [name for _, name in beside], done.stdout
        assert f"{base}_{database}_workers" not in [name for _, name in beside]
        after = rf"^ after  .*\(IO_TEST_DB_NAME={base}_{database}_workers,"
        assert re.search(after, done.stdout, re.M), done.stdout
    assert len(beside) >= 4
