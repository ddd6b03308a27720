"""``@idempotent`` on a ``django.tasks`` task (Django 6, or the django-tasks backport on 5.2)."""

from __future__ import annotations

from typing import Any

import pytest

from idempotent_orders.idempotent import idempotent
from idempotent_orders.models import Outcome, ProcessedMessage
from tests.support.services import unavailable

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
    assert idempotent_above_task.module_path == "tests.test_contrib_tasks.idempotent_above_task"
