"""Run the test suite once per (virtual environment, database) leg and sum the results.

Legs whose database is unreachable are reported and not run on a newcomer's
machine; with ``CI=true`` they fail the run instead.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
SERVICES = {"postgres": ("127.0.0.1", 5432), "mariadb": ("127.0.0.1", 3306)}

# What the Django 6 legs repeat. Their job is the other Django and Python: the ORM,
# admin, checks, migrations and views, all of which run in-process on every database.
# What starts real Celery worker processes (marker ``workers``), whose behaviour does
# not depend on Django's version, runs in full on the Django 5.2 legs of every
# database, and once more on Django 6's PostgreSQL leg, but for the long runs (marker
# ``heavy``: the chaos runs and a retry held by the broker, the longest tests).
REPEAT = {
    "postgres": "not heavy",
    "mariadb": "not workers",
    "sqlite": "not workers",
}


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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--venv", default=".venv")
    parser.add_argument("--venv-dj6", default=None)
    parser.add_argument("--databases", default="sqlite,postgres,mariadb")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()

    legs = [(args.venv, db, "") for db in args.databases.split(",")]
    if args.venv_dj6:
        legs += [(args.venv_dj6, db, REPEAT.get(db, "")) for db in args.databases.split(",")]
    elif IN_CI:
        print("matrix: no Python >= 3.12 for the Django 6 leg (required in CI)")
        return 1

    totals = {"passed": 0, "failed": 0, "skipped": 0}
    problems: list[str] = []
    report_dir = ROOT / ".pytest_cache" / "matrix"
    report_dir.mkdir(parents=True, exist_ok=True)
    for venv, database, selection in legs:
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
        title = f"{database} | {version}"
        reason = why_not(python, database)
        if reason:
            message = f"leg {title}: not run: {reason}"
            print(f"\n=== {message}", flush=True)
            problems.append(message)
            continue
        # Each leg runs twice: the default order model, then a project's own
        # model swapped in (tests/swapped, its own process: the model is
        # chosen once per process, like the user model).
        for suite, settings_module in (
            ("", "tests.settings"),
            ("-swapped", "tests.settings_swapped"),
        ):
            junit = report_dir / f"{Path(venv).name}-{database}{suite}.xml"
            junit.unlink(missing_ok=True)
            env = {
                **os.environ,
                "DJANGO_SETTINGS_MODULE": settings_module,
                "IO_TEST_DATABASE": database,
                "IO_TEST_DB_NAME": os.environ.get("IO_TEST_DB_NAME", "test_io") + f"_{database}",
            }
            name = f"{title}{' | own order model' if suite else ''}"
            if selection:
                name += f" | -m '{selection}'"
            print(f"\n=== leg {name}", flush=True)
            started = time.monotonic()
            result = subprocess.run(
                [
                    python,
                    "-m",
                    "pytest",
                    f"--junitxml={junit}",
                    *(["-m", selection] if selection else []),
                    *args.pytest_args,
                ],
                cwd=ROOT,
                env=env,
            )
            counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
            if junit.exists():
                for test_suite in ET.parse(junit).getroot().iter("testsuite"):
                    for key in counts:
                        counts[key] += int(test_suite.get(key, 0))
            failed = counts["failures"] + counts["errors"]
            totals["failed"] += failed
            totals["skipped"] += counts["skipped"]
            totals["passed"] += counts["tests"] - failed - counts["skipped"]
            print(
                f"=== leg {name}: exit {result.returncode}, {counts['tests']} tests, "
                f"{failed} failed, {counts['skipped']} skipped, "
                f"{time.monotonic() - started:.0f}s",
                flush=True,
            )
            if result.returncode not in (0,) or counts["tests"] == 0:
                problems.append(f"leg {name}: pytest exit {result.returncode}")

    print()
    for problem in problems:
        print(f"matrix problem: {problem}")
    ok = not problems or (
        not IN_CI and totals["failed"] == 0 and all("not run" in p for p in problems)
    )
    print(
        f"matrix: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
