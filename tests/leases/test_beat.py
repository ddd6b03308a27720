"""The recommended periodic tasks: one helper the demo and the docs use, naming real tasks."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
from celery import current_app

from idempotent_orders.beat import PERIODIC_TASKS, beat_schedule
from tests.support.services import ROOT


def test_the_schedule_holds_every_periodic_task_of_the_app() -> None:
    import idempotent_orders.tasks  # noqa: F401  (registers the tasks)

    # The app's tasks that take no argument are the periodic ones (the others consume a
    # message or fulfil an order).
    periodic = {
        name
        for name, task in current_app.tasks.items()
        if name.startswith("idempotent_orders.") and not _arguments(task)
    }
    scheduled = {entry["task"] for entry in beat_schedule().values()}
    assert scheduled == periodic
    # Among them the passes that surface what a failover leaves behind.
    assert {"idempotent_orders.reconcile", "idempotent_orders.surface_overdue_parked"} <= scheduled


def _arguments(task: object) -> list[str]:
    run = task.run  # type: ignore[attr-defined]
    return [p for p in inspect.signature(run).parameters if p != "self"]


def test_intervals_change_by_name_and_a_task_can_be_left_out() -> None:
    schedule = beat_schedule(reconcile=10, purge_outbox=None, prefix="io-")
    assert schedule["io-reconcile"] == {"task": "idempotent_orders.reconcile", "schedule": 10.0}
    assert "io-purge-outbox" not in schedule
    assert len(schedule) == len(PERIODIC_TASKS) - 1
    with pytest.raises(ValueError, match="unknown periodic task reconciler"):
        beat_schedule(reconciler=10)
    with pytest.raises(ValueError, match="positive"):
        beat_schedule(timers=0)


def test_the_demo_schedules_exactly_the_recommended_tasks(tmp_path) -> None:
    env = {**os.environ, "DEMO_STATE_DIR": str(tmp_path)}
    code = "import demo_project.settings as s; print(repr(s.CELERY_BEAT_SCHEDULE))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert eval(out.stdout) == beat_schedule()  # a dict of str and float literals


def test_the_operations_page_shows_the_helper() -> None:
    page = (ROOT / "docs" / "operations.md").read_text()
    assert "CELERY_BEAT_SCHEDULE = beat_schedule()" in page
