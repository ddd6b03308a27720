"""Section 4 (celery-once): duplicates executed when a worker is killed mid-task."""

from __future__ import annotations

import importlib.util

from bench.common import Row, na


def run() -> list[Row]:
    if importlib.util.find_spec("celery_once") is None:
        return [na("4 peers: celery-once", "dups after a worker kill", "celery-once not installed")]
    return [na("4 peers: celery-once", "dups after a worker kill", "measurement not written yet")]
