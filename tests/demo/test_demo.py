"""The demo command runs end to end on the embedded default (SQLite + filesystem broker)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.services import ROOT

pytestmark = [pytest.mark.workers, pytest.mark.backends("sqlite")]


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_demo_reports_no_double_applied_and_no_lost(tmp_path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"}
    }
    env.update(DJANGO_SETTINGS_MODULE="demo_project.settings", DEMO_STATE_DIR=str(tmp_path))
    migrate = run(["migrate", "-v0"], env)
    assert migrate.returncode == 0, migrate.stderr
    demo = run(["run_demo", "--orders", "20", "--workers", "2", "--seed", "1"], env)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "all invariants hold" in demo.stdout
    lines = dict(
        line.split(None, 1)
        for line in demo.stdout.splitlines()
        if line.startswith("  ") and len(line.split(None, 1)) == 2
    )
    assert lines["double-applied"].strip() == "0"
    assert lines["lost"].strip() == "0"
    assert lines["completed"].strip() == "20"
    # Each order's loyalty follow-up went through the outbox and was applied once.
    assert re.search(r"outbox follow-ups\s+20 \(0 unsent\)", demo.stdout), demo.stdout
    assert re.search(r"wrong loyalty points\s+0\n", demo.stdout), demo.stdout
    # A stale inbox row is explained: a fulfilment step the order's shipment overtook.
    stale = re.search(r"\n    stale\s+(\d+)( \((\d+) fulfilment steps: [^)]+\))?\n", demo.stdout)
    assert stale is not None, demo.stdout
    assert stale[1] == (stale[3] or "0"), demo.stdout


def test_demo_beat_runs_the_periodic_tasks(tmp_path) -> None:
    env = {**os.environ, "DEMO_STATE_DIR": str(tmp_path)}
    code = (
        "import demo_project.settings as s; "
        "print(*sorted(e['task'] for e in s.CELERY_BEAT_SCHEDULE.values()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    scheduled = set(out.stdout.split())
    assert {
        "idempotent_orders.reconcile",
        "idempotent_orders.purge",
        "idempotent_orders.fire_due_timers",
        "idempotent_orders.relay_outbox",
        "idempotent_orders.surface_overdue_parked",
    } <= scheduled
