"""The outbox's background publisher across a fork and at interpreter exit (real processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.services import ROOT, worker_env


def run(tmp_path: Path, mode: str) -> list[list[str]]:
    out = tmp_path / "published"
    env = worker_env(broker_url="memory://", queue=f"publisher-{mode}")
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.publisher_process", str(out), mode],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [line.split() for line in out.read_text().splitlines()]


def test_a_forked_child_gets_its_own_queue_and_never_publishes_the_parents_ids(
    tmp_path: Path,
) -> None:
    lines = run(tmp_path, "fork")
    assert ["child-exit", "0"] in lines
    batches = [line for line in lines if line[0] != "child-exit"]
    parent = {line[0] for line in batches if "1" in line[1:]}
    assert len(parent) == 1
    by_pid: dict[str, list[str]] = {}
    for pid, *ids in batches:
        by_pid.setdefault(pid, []).extend(ids)
    (child,) = set(by_pid) - parent
    # The child published its own id (flushed at its exit), none of the parent's.
    assert by_pid[child] == ["100"]
    # The parent's ids were published once each, by the parent.
    assert sorted(by_pid[parent.pop()]) == ["1", "2", "3"]


def test_ids_handed_over_just_before_exit_are_published_by_the_exit_hook(
    tmp_path: Path,
) -> None:
    lines = run(tmp_path, "exit")
    published = [pk for _, *ids in lines for pk in ids]
    assert sorted(published, key=int) == ["1", "2", "3", "4", "5"]
    assert len({pid for pid, *_ in lines}) == 1
