"""On the demo's embedded default (SQLite, filesystem broker, a process-local cache), a
Celery worker with its embedded beat is SIGKILLed: /admin/ (served by another process)
counts the worker and the reconciler as not heard from within 90 s, on a laptop's screen
and a desktop's, the lines inside the window."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import CHROMIUM, LAUNCH_ARGS, SCREENSHOTS, require_chromium
from tests.support.services import ROOT, free_port, wait_until

# The run waits out the demo's one-minute threshold: marked ``waits``, it runs beside the
# other legs of the matrix instead of in the SQLite leg's line.
pytestmark = [
    pytest.mark.workers,
    pytest.mark.browser,
    pytest.mark.waits,
    pytest.mark.backends("sqlite"),
]

PASSWORD = "operator-pw"
VIEWPORTS = [(1280, 800), (1920, 1080)]


def demo_env(state: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE"}
    }
    env.update(DJANGO_SETTINGS_MODULE="demo_project.settings", DEMO_STATE_DIR=str(state))
    return env


def manage(env: dict[str, str], *args: str) -> None:
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The demo as `make demo-web` runs it: runserver, and one worker with beat."""
    env = demo_env(tmp_path)
    manage(env, "migrate", "-v0")
    manage(
        env,
        "shell",
        "-c",
        "from django.contrib.auth import get_user_model; "
        f"get_user_model().objects.create_superuser('operator', 'op@example.com', '{PASSWORD}')",
    )
    port = free_port()
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in ("worker", "server")}
    celery = ["-m", "celery", "-A", "demo_project", "worker", "--beat", "--concurrency", "1"]
    worker = subprocess.Popen(
        [sys.executable, *celery, "--schedule", str(tmp_path / "beat-schedule"), "-l", "info"],
        cwd=ROOT,
        env=env,
        stdout=logs["worker"],
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = subprocess.Popen(
        [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"],
        cwd=ROOT,
        env=env,
        stdout=logs["server"],
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield {"url": f"http://127.0.0.1:{port}", "worker": worker, "state": tmp_path}
    finally:
        for process in (worker, server):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        for log in logs.values():
            log.close()


def log_tail(state: Path) -> str:
    return "\n".join(
        f"--- {name}\n" + (state / f"{name}.log").read_text()[-3000:]
        for name in ("worker", "server")
    )


def test_a_killed_worker_and_reconciler_show_on_the_admin_within_90_s(
    demo: dict[str, Any],
) -> None:
    sync_api = require_chromium()
    url = demo["url"]
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})

            def admin_says(wanted: dict[str, str]) -> bool:
                try:
                    page.goto(f"{url}/admin/")
                except sync_api.Error:
                    return False  # the server is still starting
                if "login" in page.url:
                    page.fill("#id_username", "operator")
                    page.fill("#id_password", PASSWORD)
                    with page.expect_navigation():
                        page.click("input[type=submit]")
                return all(
                    (page.text_content(f"#attention-{key} td.note") or "").find(text) >= 0
                    for key, text in wanted.items()
                )

            alive = {"workers_gone": "1 heard from", "reconciler": "last pass"}
            assert wait_until(lambda: admin_says(alive), timeout=90, interval=2), log_tail(
                demo["state"]
            )
            assert page.text_content("#attention-workers_gone td.count") == "0"
            assert page.text_content("#attention-reconciler td.count") == "0"

            os.killpg(demo["worker"].pid, signal.SIGKILL)  # the worker and its beat
            demo["worker"].wait(timeout=30)

            def both_dead() -> bool:
                admin_says({})
                return (
                    page.text_content("#attention-workers_gone td.count") == "1"
                    and page.text_content("#attention-reconciler td.count") == "1"
                )

            assert wait_until(both_dead, timeout=90, interval=3), log_tail(demo["state"])
            note = page.text_content("#attention-workers_gone td.note") or ""
            shown = {}
            for width, height in VIEWPORTS:
                page.set_viewport_size({"width": width, "height": height})
                page.goto(f"{url}/admin/")
                shown[width] = [
                    page.locator(f"#attention-{key} {cell}").bounding_box()
                    for key in ("workers_gone", "reconciler")
                    for cell in ("th", "td.count", "td.note")
                ]
                SCREENSHOTS.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(SCREENSHOTS / f"admin-dead-worker-{width}.png"))
        finally:
            browser.close()
    assert note.startswith("gone: ")
    assert note.endswith("0 heard from in the last minute")
    for width, height in VIEWPORTS:
        for box in shown[width]:
            assert box is not None
            assert box["x"] >= 0
            assert box["x"] + box["width"] <= width
            assert box["y"] >= 0
            assert box["y"] + box["height"] <= height
