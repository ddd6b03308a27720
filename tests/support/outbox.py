"""Relay processes for the outbox tests: start several together, read what each published."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

from tests.support.services import ROOT, worker_env


def run_relays(
    tmp_path: Path, count: int, *, batch: int = 10, stall_after: int = 0
) -> tuple[list[subprocess.Popen[bytes]], Path, Path]:
    """Start ``count`` relay processes together; the first stalls after ``stall_after``."""
    go, log, marker = tmp_path / "go", tmp_path / "publishes.log", tmp_path / "stalled"
    go.unlink(missing_ok=True)
    env = worker_env(broker_url="memory://", queue=f"relay-{uuid.uuid4().hex}")
    relays = []
    for n in range(count):
        args = [
            sys.executable,
            "-m",
            "tests.support.outbox_parallel_relay",
            str(log),
            str(go),
            str(batch),
        ]
        if n == 0 and stall_after:
            args += [str(stall_after), str(marker)]
        relays.append(subprocess.Popen(args, cwd=ROOT, env=env, start_new_session=True))
    go.touch()
    return relays, log, marker


def publishes(log: Path) -> list[tuple[int, str]]:
    """(relay pid, message id) of every publish, in the order they happened."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [(int(pid), mid) for pid, mid in (line.split() for line in lines)]
