"""Metrics across processes (prometheus-client's multiprocess mode) and who may read them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from celery.signals import worker_process_shutdown
from django.conf import settings
from django.core import checks
from django.test import Client, override_settings

from idempotent_orders.observability import mark_process_dead
from tests.support.metrics import sample
from tests.support.services import ROOT

pytestmark = pytest.mark.django_db

TOKEN = "s3cret-scraper-token-0123456789"


def io(**values: object) -> dict[str, object]:
    """The test settings' IDEMPOTENT_ORDERS with ``values`` instead."""
    base = {k: v for k, v in settings.IDEMPOTENT_ORDERS.items() if not k.startswith("METRICS_")}
    return {**base, **values}


def counting_process(directory: Path, times: int) -> int:
    """Run a process that counts ``times`` messages into ``directory``; its pid."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.metrics_process", str(times)],
        cwd=ROOT,
        env={**_env(), "PROMETHEUS_MULTIPROC_DIR": str(directory)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}


@pytest.mark.same_everywhere
def test_the_view_adds_up_the_counters_of_every_process(tmp_path, monkeypatch) -> None:
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.metrics_process", str(times)],
            cwd=ROOT,
            env={**_env(), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for times in (1, 2, 4)
    ]
    pids = []
    for process in processes:
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0
        pids.append(int(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"counter_{p}.db" for p in pids)
    # gunicorn's child_exit would say so for each: the counters of exited processes stay.
    for pid in pids[:2]:
        mark_process_dead(pid)

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    response = Client().get("/metrics")
    assert response.status_code == 200
    text = response.content.decode()
    applied = {"consumer": "payments", "outcome": "applied"}
    assert sample(text, "idempotent_orders_messages_total", **applied) == 7
    assert sample(text, "idempotent_orders_dedup_layer_hits_total", layer="redis") == 7
    # The database gauges are read once per scrape, not once per process.
    assert text.count("\nidempotent_orders_failed_messages ") == 1
    assert text.count("\nidempotent_orders_outbox_pending ") == 1


@pytest.mark.same_everywhere
def test_a_fourth_process_adds_to_the_sum(tmp_path, monkeypatch) -> None:
    counting_process(tmp_path, 3)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    before = Client().get("/metrics").content.decode()
    counting_process(tmp_path, 5)
    after = Client().get("/metrics").content.decode()
    name = "idempotent_orders_dedup_layer_hits_total"
    assert (sample(before, name, layer="redis"), sample(after, name, layer="redis")) == (3, 8)


def test_celery_process_shutdown_marks_the_process_dead(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    for name in ("gauge_livesum_4242.db", "gauge_livesum_4343.db", "counter_4242.db"):
        (tmp_path / name).write_bytes(b"")
    worker_process_shutdown.send(sender=None, pid=4242, exitcode=0)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["counter_4242.db", "gauge_livesum_4343.db"]


def test_metrics_are_refused_without_a_token_and_served_with_it() -> None:
    with override_settings(IDEMPOTENT_ORDERS=io(METRICS_TOKEN=TOKEN)):
        refused = Client().get("/metrics")
        wrong = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer not-the-token")
        basic = Client().get("/metrics", HTTP_AUTHORIZATION=f"Basic {TOKEN}")
        allowed = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert (refused.status_code, wrong.status_code, basic.status_code) == (401, 401, 401)
    assert refused["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert b"idempotent_orders" not in refused.content
    assert allowed.status_code == 200
    assert b"idempotent_orders_messages_total" in allowed.content


def test_an_allowed_network_reads_without_a_token() -> None:
    with override_settings(IDEMPOTENT_ORDERS=io(METRICS_ALLOW_IPS=["10.1.0.0/16", "::1"])):
        inside = Client(REMOTE_ADDR="10.1.2.3").get("/metrics")
        ipv6 = Client(REMOTE_ADDR="::1").get("/metrics")
        outside = Client(REMOTE_ADDR="10.2.0.1").get("/metrics")
        garbage = Client(REMOTE_ADDR="").get("/metrics")
    assert (inside.status_code, ipv6.status_code) == (200, 200)
    assert (outside.status_code, garbage.status_code) == (403, 403)
    both = io(METRICS_ALLOW_IPS=["10.1.0.0/16"], METRICS_TOKEN=TOKEN)
    with override_settings(IDEMPOTENT_ORDERS=both):
        outside_with_token = Client(REMOTE_ADDR="10.2.0.1").get(
            "/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}"
        )
        outside_without = Client(REMOTE_ADDR="10.2.0.1").get("/metrics")
    assert (outside_with_token.status_code, outside_without.status_code) == (200, 401)


def test_unconfigured_metrics_are_open_only_under_debug() -> None:
    with override_settings(IDEMPOTENT_ORDERS=io()):
        closed = Client().get("/metrics")
        with override_settings(DEBUG=True):
            debug = Client().get("/metrics")
    with override_settings(IDEMPOTENT_ORDERS=io(METRICS_PUBLIC=True)):
        public = Client(REMOTE_ADDR="203.0.113.9").get("/metrics")
    assert closed.status_code == 403
    assert b"METRICS_TOKEN" in closed.content
    assert (debug.status_code, public.status_code) == (200, 200)


def check_ids(**values: object) -> set[str]:
    with override_settings(IDEMPOTENT_ORDERS=io(**values)):
        return {m.id for m in checks.run_checks() if (m.id or "").startswith("idempotent")}


def test_the_metrics_check_names_what_is_wrong(tmp_path, monkeypatch) -> None:
    assert check_ids(METRICS_TOKEN=TOKEN) == set()
    assert check_ids(METRICS_TOKEN="short") == {"idempotent_orders.E090"}
    assert check_ids(METRICS_ALLOW_IPS=["10.0.0.0/8", "intranet"]) == {"idempotent_orders.E091"}
    # The demo's URLconf routes the view: closed outside DEBUG is worth a warning.
    assert check_ids() == {"idempotent_orders.W090"}
    with override_settings(DEBUG=True):
        assert check_ids() == set()
    assert check_ids(METRICS_PUBLIC=True) == set()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    assert check_ids(METRICS_TOKEN=TOKEN) == {"idempotent_orders.E092"}
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert check_ids(METRICS_TOKEN=TOKEN) == set()
