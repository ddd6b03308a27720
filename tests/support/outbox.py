"""Relay processes for the outbox tests: start several together, read what each published."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.support.services import ROOT, worker_env


def run_relays(
    tmp_path: Path, count: int, *, batch: int = 10, stall_after: int = 0
) -> tuple[list[subprocess.Popen[bytes]], Path, Path]:
    """Start ``count`` relay processes together; the first stalls after ``stall_after``.

    They start relaying together once each is ready (Django set up): a relay that took
    longer to start than the others to relay every row would find none left.
    """
    go, log, marker = tmp_path / "go", tmp_path / "publishes.log", tmp_path / "stalled"
    go.unlink(missing_ok=True)
    ready = tmp_path / "ready"
    shutil.rmtree(ready, ignore_errors=True)
    ready.mkdir()
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
            str(ready),
        ]
        if n == 0 and stall_after:
            args += [str(stall_after), str(marker)]
        relays.append(subprocess.Popen(args, cwd=ROOT, env=env, start_new_session=True))
    deadline = time.monotonic() + 120
    while len(list(ready.iterdir())) < count:
        exited = [relay.returncode for relay in relays if relay.poll() is not None]
        assert not exited, f"a relay exited before it was ready: {exited}"
        assert time.monotonic() < deadline, "the relays were not ready in 120 s"
        time.sleep(0.05)
    go.touch()
    return relays, log, marker


def publishes(log: Path) -> list[tuple[int, str]]:
    """(relay pid, message id) of every publish, in the order they happened."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [(int(pid), mid) for pid, mid in (line.split() for line in lines)]
