"""``@idempotent`` on a ``django.tasks`` task (Django 6, or the django-tasks backport on 5.2)."""

from __future__ import annotations

import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.db.models import F

from idempotent_orders import get_order_model
from idempotent_orders.idempotent import idempotent
from idempotent_orders.models import Outcome, ProcessedMessage
from tests.support.services import unavailable

ROOT = Path(__file__).resolve().parents[2]

try:
    from django.tasks import Task, task
except ImportError:
    try:
        from django_tasks import task
        from django_tasks.base import Task
    except ImportError:  # reported by the tests (fail in CI, skip elsewhere)
        task = None

pytestmark = [pytest.mark.django_db]

#: Messages each task body ran for, by task.
RAN: dict[str, list[str]] = {"below": [], "above": []}

if task is not None:

    @task()
    @idempotent(key="message_id", consumer="tests.tasks.below")
    def idempotent_below_task(message: dict[str, Any]) -> dict[str, Any]:
        RAN["below"].append(message["message_id"])
        return {"points": len(RAN["below"]) * 10}

    @idempotent(key="message_id", consumer="tests.tasks.above")
    @task(priority=5)
    def idempotent_above_task(message: dict[str, Any]) -> dict[str, Any]:
        RAN["above"].append(message["message_id"])
        return {"points": len(RAN["above"]) * 10}

    if getattr(django_settings, "TASKS_DB_BACKEND", False):

        @task(backend="db")
        @idempotent(key="message_id", consumer="tests.tasks.worker")
        def add_a_point_task(message: dict[str, Any]) -> int:
            """Not idempotent by itself: each run adds one to the order's amount."""
            model = get_order_model()
            model._default_manager.filter(pk=message["order_id"]).update(amount=F("amount") + 1)
            return int(model._default_manager.get(pk=message["order_id"]).amount)


@pytest.fixture(autouse=True)
def _tasks(settings: Any) -> None:
    if task is None:
        unavailable(
            "neither django.tasks nor django-tasks is installed",
            hint="Django 6, or pip install --group test",
        )
    for ran in RAN.values():
        ran.clear()


@pytest.mark.parametrize("where", ["below", "above"])
def test_a_task_runs_once_per_message(where: str) -> None:
    the_task = idempotent_below_task if where == "below" else idempotent_above_task
    assert isinstance(the_task, Task)
    message = {"message_id": "m-1"}
    first = the_task.enqueue(message)
    again = the_task.enqueue(message)
    other = the_task.enqueue({"message_id": "m-2"})
    assert first.status == again.status == other.status == "SUCCESSFUL"
    assert RAN[where] == ["m-1", "m-2"]
    assert first.return_value == again.return_value == {"points": 10}
    assert other.return_value == {"points": 20}
    row = ProcessedMessage.objects.get(consumer=f"tests.tasks.{where}", message_id="m-1")
    assert (row.outcome, row.result) == (Outcome.APPLIED, {"points": 10})


def test_above_the_task_keeps_its_options() -> None:
    assert idempotent_above_task.priority == 5
    assert (
        idempotent_above_task.module_path == "tests.http.test_contrib_tasks.idempotent_above_task"
    )


@pytest.mark.django_db(transaction=True)
def test_a_db_worker_process_runs_a_duplicated_message_once(make_order: Any) -> None:
    """A real ``db_worker`` process (django-tasks-db) takes duplicated enqueues of one message."""
    if not getattr(django_settings, "TASKS_DB_BACKEND", False):
        unavailable("django-tasks-db is not installed", hint="pip install -e '.[test]'")
    order = make_order(amount=Decimal("10.00"))
    first = {"message_id": "w-1", "order_id": order.pk}
    second = {"message_id": "w-2", "order_id": order.pk}
    results = [add_a_point_task.enqueue(m) for m in (first, first, second, first, second)]
    env = {
        **os.environ,
        "IO_WORKER_DB": "1",
        "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "tests.settings"),
    }
    worker = subprocess.run(
        [
            *(sys.executable, "-m", "django", "db_worker", "--backend", "db", "--batch"),
            *("--no-startup-delay", "--worker-id", "tests-db-worker"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert worker.returncode == 0, worker.stderr[-3000:]
    order.refresh_from_db()
    assert order.amount == Decimal("12.00")  # two messages, each applied once
    for result in results:
        result.refresh()
    assert {r.status for r in results} == {"SUCCESSFUL"}
    # Every copy of a message returns its one run's result.
    by_message: dict[str, set[int]] = {}
    for message, result in zip((first, first, second, first, second), results, strict=True):
        by_message.setdefault(message["message_id"], set()).add(result.return_value)
    assert sorted(by_message.values(), key=min) == [{11}, {12}]
    assert ProcessedMessage.objects.filter(consumer="tests.tasks.worker").count() == 2
