"""Headless Chromium for the browser tests (Debian's chromium, driven by Playwright)."""

from __future__ import annotations

import mimetypes
import os
import shutil
from pathlib import Path
from typing import Any

import django.contrib.admin

from tests.support.scratch import SCRATCH
from tests.support.services import ROOT, unavailable

CHROMIUM = os.environ.get("IO_TEST_CHROMIUM", "/usr/bin/chromium")
#: Where the browser tests save their pictures: ``IO_TEST_SCREENSHOTS`` (tests/support/matrix.py
#: gives each leg its own), else screenshots/ in the tests' scratch folder
#: (tests/support/scratch.py). Never docs/img/: copy a picture there to refresh the documentation.
SCREENSHOTS = Path(os.environ.get("IO_TEST_SCREENSHOTS") or SCRATCH / "screenshots")

LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def require_chromium() -> Any:
    """Playwright's sync API, or skip (fail in CI) with the reason."""
    missing = []
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        missing.append(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    try:
        from playwright import sync_api
    except ImportError:
        missing.append("Playwright is not installed (pip install --group test)")
        sync_api = None
    if missing:
        unavailable("; ".join(missing), required="the browser test is required")
    return sync_api


#: Where the pages' static files are: the admin's, this app's admin stylesheet, the demo shop's.
STATIC_DIRS = [
    Path(django.contrib.admin.__file__).parent / "static",
    ROOT / "idempotent_orders" / "static",
    ROOT / "demo_project" / "static",
]


def serve_static(route: Any) -> None:
    """A Playwright route handler serving ``/static/`` for the live server, which has no
    static files app in the tests: the admin's CSS and JS, the shop's stylesheet."""
    path = route.request.url.split("/static/", 1)[1].split("?", 1)[0]
    for folder in STATIC_DIRS:
        file = (folder / path).resolve()
        if file.is_relative_to(folder) and file.is_file():
            kind = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
            route.fulfill(status=200, body=file.read_bytes(), headers={"Content-Type": kind})
            return
    route.fulfill(status=404, body="")
