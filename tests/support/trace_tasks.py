"""A task for the trace tests, imported by test workers (``CELERY_IMPORTS`` in tests.settings).

It writes the trace context it runs in to ``message["path"]`` (one JSON line a
hop) and, while ``hops`` remain, queues itself again through the outbox
without naming a trace: the next hop must inherit it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from celery import shared_task
from django.db import transaction

from idempotent_orders import tracing


@shared_task(name="tests.record_trace")
def record_trace(message: dict[str, Any]) -> None:
    from idempotent_orders.outbox import publish_on_commit

    context = tracing.current()
    with Path(message["path"]).open("a") as out:
        out.write(json.dumps({"hop": message["hop"], **vars(context)}) + "\n")
    if message["hop"] < message["hops"]:
        with transaction.atomic():
            publish_on_commit(record_trace, {**message, "hop": message["hop"] + 1})
