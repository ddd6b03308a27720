"""Headless Chromium for the browser tests (Debian's chromium, driven by Playwright)."""

from __future__ import annotations

import os
import shutil
from typing import Any

from tests.support.services import unavailable

CHROMIUM = os.environ.get("IO_TEST_CHROMIUM", "/usr/bin/chromium")
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
