"""Workers and the reconciler leave heartbeats; the dashboard says who went quiet."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.test import Client

from idempotent_orders import liveness
from idempotent_orders.admin import attention

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_beats() -> None:
    from idempotent_orders.models import Heartbeat

    Heartbeat.objects.all().delete()


def lines(user: Any) -> dict[str, Any]:
    return {line.key: line for line in attention(user)}


def test_the_dashboard_names_a_worker_gone_quiet_and_a_late_reconciler(staff: Client) -> None:
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.get(username="operator")
    shown = lines(user)
    assert shown["workers_gone"].count == 0
    assert shown["reconciler"].count == 1  # never heard from
    assert "Celery beat" in shown["reconciler"].note

    now = time.time()
    liveness.beat("worker:w1@host", at=now)
    liveness.beat("worker:w2@host", at=now - 3 * liveness.SILENT_AFTER)
    liveness.beat("reconciler", at=now - 30)
    shown = lines(user)
    assert shown["workers_gone"].count == 1
    assert shown["workers_gone"].note == "gone: w2@host; 1 heard from in the last minute"
    assert shown["reconciler"].count == 0
    assert shown["reconciler"].note.startswith("last pass ")

    page = staff.get("/admin/").content.decode()
    assert "Workers not heard from" in page
    assert "gone: w2@host" in page


def test_beats_older_than_an_hour_are_forgotten() -> None:
    now = time.time()
    liveness.beat("worker:old", at=now - liveness.FORGET - 5)
    liveness.beat("worker:new", at=now)
    assert set(liveness.ages("worker:")) == {"worker:new"}


def test_a_reconciler_pass_beats() -> None:
    from idempotent_orders.tasks import reconcile

    reconcile.run()
    assert liveness.ages("reconciler")["reconciler"] < 60


@pytest.mark.workers
@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_beats(celery_workers: Any) -> None:
    from tests.support.services import wait_until

    workers = celery_workers("redis", processes=1)
    assert wait_until(lambda: bool(liveness.ages("worker:")), timeout=60), workers.log_tail()
    assert min(liveness.ages("worker:").values()) < liveness.SILENT_AFTER


def test_a_process_local_cache_does_not_hide_the_beats(settings: Any) -> None:
    """The beats are rows: a process-local LOCK_CACHE (the demo's default) changes nothing."""
    from django.contrib.auth import get_user_model

    settings.CACHES = {
        **settings.CACHES,
        "local": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    }
    settings.IDEMPOTENT_ORDERS = {**settings.IDEMPOTENT_ORDERS, "LOCK_CACHE": "local"}
    user = get_user_model().objects.create_superuser("op2", "op2@example.com", "pw")
    liveness.beat("worker:w9@host", at=time.time() - 2 * liveness.SILENT_AFTER)
    liveness.beat("reconciler", at=time.time() - 10)
    shown = lines(user)
    assert shown["workers_gone"].count == 1
    assert shown["reconciler"].count == 0
    assert shown["reconciler"].note == "last pass 10 seconds ago"


def test_the_reconciler_is_late_after_two_of_its_scheduled_intervals(settings: Any) -> None:
    from idempotent_orders.beat import beat_schedule

    settings.CELERY_BEAT_SCHEDULE = beat_schedule(reconcile=45.0)
    assert liveness.reconciler_silent_after() == 90.0
    settings.CELERY_BEAT_SCHEDULE = beat_schedule(reconcile=5.0)
    assert liveness.reconciler_silent_after() == liveness.SILENT_AFTER
    settings.CELERY_BEAT_SCHEDULE = {}
    assert liveness.reconciler_silent_after() == 300.0


def test_no_worker_ever_heard_from_is_said(staff: Client) -> None:
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.get(username="operator")
    assert "is a Celery worker running?" in lines(user)["workers_gone"].note


def test_many_gone_workers_keep_the_note_short(staff: Client) -> None:
    from django.contrib.auth import get_user_model

    old = time.time() - 3 * liveness.SILENT_AFTER
    for n in range(6):
        liveness.beat(f"worker:celery-{n}-" + "x" * 60 + "@host", at=old)
    user = get_user_model().objects.get(username="operator")
    note = lines(user)["workers_gone"].note
    assert note.endswith("and 3 more; 0 heard from in the last minute")
    assert len(note) < 200
