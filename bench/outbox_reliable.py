"""The outbox section's second peer, django-reliable-outbox 0.1.1, driven in its own venv.

It needs Python >= 3.12, the benchmark runs on the project's venv: ``make bench``
builds ``.venv-bench-peer`` (Python >= 3.12, the project and pyproject's
``bench-peer`` group, Django 5.2 as in the benchmark's venv) and the section
starts ``python -m bench.outbox_reliable`` there. It reads one JSON command a
line on stdin and answers each with one JSON line on stdout (anything else it
prints goes to stderr):

- ``{"cmd": "producer", "modes": [...], "queue": Q}``: the median ms of the
  caller's order-creating transaction per mode, as ``bench.outbox._producer_ms``
  measures ours: ``baseline``, ``reliable`` (its ``publish()`` in the
  transaction) and ``outbox`` (our default ``publish_on_commit``, here on
  Python 3.12 beside it).
- ``{"cmd": "relay", "rows": N, "queue": Q}``: N events written (one
  transaction), then one ``Worker`` (batch 100, no LISTEN) in burst mode until
  none is left; msg/s.
- ``{"cmd": "crash", ...}``: its worker SIGKILLed mid-batch (as the section's
  crash rows), then a new worker; lost, re-sent, effects applied twice through
  its inbox (``inbox.claim`` in the consumer's transaction), seconds held.

Its events reach the broker through :class:`CeleryTaskDestination` (its README:
"a destination whose ``deliver`` calls ``task.delay()`` is a few lines"): each
event is published as the Celery task of its name (``demo_project.award_points``)
with the event's payload as the argument and its ``message_id`` as the task id,
to the section's queue: what our relay publishes, on the same broker.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any

from bench.common import CRASH_LEASE_S


class CeleryTaskDestination:
    """A django-reliable-outbox destination: ``deliver`` publishes the event as the Celery
    task of its name (``apply_async`` of the registered task, else ``send_task``) and
    returns once the publish returned.
    """

    def __init__(self, *, queue: str) -> None:
        self.queue = queue

    def deliver(self, envelope: Any) -> None:
        from celery import current_app

        options = {"task_id": str(envelope.message_id), "queue": self.queue}
        task = current_app.tasks.get(envelope.name)
        if task is not None:
            task.apply_async(args=(envelope.payload,), **options)
        else:
            current_app.send_task(envelope.name, args=(envelope.payload,), **options)


def _to(queue: str) -> Any:
    """Settings under which its default destination publishes to ``queue``."""
    from django.conf import settings
    from django.test import override_settings

    destination = {"BACKEND": f"{__name__}.CeleryTaskDestination", "OPTIONS": {"queue": queue}}
    return override_settings(
        RELIABLE_OUTBOX={**settings.RELIABLE_OUTBOX, "DESTINATIONS": {"default": destination}}
    )


def _write(events: list[dict[str, Any]]) -> list[str]:
    """Write ``events`` (award_points payloads) in one transaction; their message ids."""
    from django.db import transaction
    from reliable_outbox import publish

    from demo_project.tasks import award_points

    with transaction.atomic():
        return [str(publish(award_points.name, event)) for event in events]


def _relay_rate(rows: int) -> dict[str, Any]:
    from reliable_outbox.models import OutboxMessage
    from reliable_outbox.worker import Worker

    OutboxMessage.objects.all().delete()
    tag = uuid.uuid4().hex[:8]
    _write([{"message_id": f"rel-{tag}-{i}", "customer": "b", "points": 1} for i in range(rows)])
    worker = Worker(batch_size=100, notify=False)
    start = time.perf_counter()
    worker.run(burst=True)
    elapsed = time.perf_counter() - start
    delivered = OutboxMessage.objects.filter(status="delivered").count()
    return {"rate": rows / elapsed, "delivered": delivered}


def _crash(rows: int, after: int, queue: str) -> dict[str, Any]:
    """Its worker SIGKILLed after ``after`` publishes of ``rows`` events, then a new one."""
    import subprocess
    import tempfile
    from pathlib import Path

    from django.db import transaction
    from django.db.models import F
    from reliable_outbox import inbox
    from reliable_outbox.models import OutboxMessage
    from reliable_outbox.worker import Worker

    from bench.common import ROOT, kill_at_marker
    from bench.outbox import _drain_all
    from demo_project.models import LoyaltyAccount

    OutboxMessage.objects.all().delete()
    tag = uuid.uuid4().hex[:8]
    customer = f"crash-reliable-{tag}"
    created = set(
        _write(
            [
                {"message_id": f"crash-{tag}-{i}", "customer": customer, "points": 1}
                for i in range(rows)
            ]
        )
    )
    env = {**os.environ, "BENCH_PEER_QUEUE": queue}
    with tempfile.TemporaryDirectory() as tmp:
        log, marker = Path(tmp) / "published", Path(tmp) / "stalled"
        relay = subprocess.Popen(
            [
                *(sys.executable, "-m", "bench.outbox_crash_relay", "reliable"),
                *(os.environ.get("BENCH_PEER_BROKER_URL", ""), str(after), str(log), str(marker)),
            ],
            cwd=ROOT,
            env=env,
            start_new_session=True,
            stdout=sys.stderr,
        )
        killed = kill_at_marker(relay, marker, "its worker")
        published = set(log.read_text().split())
    worker = Worker(batch_size=100, lease_seconds=CRASH_LEASE_S, notify=False)
    waiting = OutboxMessage.objects.filter(message_id__in=published, status="pending")
    held = 0.0
    while OutboxMessage.objects.filter(status="pending").exists():
        if not worker.run_once():
            time.sleep(0.01)
        if not held and not waiting.exists():
            held = time.monotonic() - killed
    delivered = _drain_all(queue, rows)
    ids = [mid for mid, _ in delivered]
    distinct = set(ids)
    account, _ = LoyaltyAccount.objects.get_or_create(customer=customer)
    for mid, payload in delivered:  # its consumer: the inbox in the transaction of the effect
        with transaction.atomic():
            if inbox.claim(mid, consumer="bench-points"):
                LoyaltyAccount.objects.filter(pk=account.pk).update(
                    points=F("points") + payload["points"]
                )
    applied = LoyaltyAccount.objects.get(pk=account.pk).points
    return {
        "lost": rows - len(distinct & created),
        "resent": len(ids) - len(distinct),
        "twice": applied - len(distinct),
        "held": held,
        "dead_published": len(published),
    }


def _handle(command: dict[str, Any]) -> dict[str, Any]:
    from bench import outbox

    cmd = command["cmd"]
    if cmd == "producer":
        return {"ms": {m: outbox._producer_ms(m, command["queue"]) for m in command["modes"]}}
    if cmd == "relay":
        with _to(command["queue"]):
            return _relay_rate(command["rows"])
    if cmd == "crash":
        with _to(command["queue"]):
            return _crash(command["rows"], command["after"], command["queue"])
    raise ValueError(f"unknown command {cmd!r}")


def main() -> None:
    # Answers go to the real stdout; whatever else writes to stdout goes to stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.outbox_reliable_settings")
    import django

    django.setup()
    from celery import current_app
    from django.core.management import call_command

    current_app.conf.broker_url = os.environ.get("BENCH_PEER_BROKER_URL", "memory://")
    call_command("migrate", "reliable_outbox", verbosity=0, interactive=False)
    import reliable_outbox

    version = getattr(reliable_outbox, "__version__", "")
    answers.write(json.dumps({"ready": True, "python": sys.version.split()[0], "version": version}))
    answers.write("\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = _handle(json.loads(line))
        except Exception as exc:
            answer = {"error": repr(exc)[:300]}
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
