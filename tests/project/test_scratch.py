"""What the tests write goes to their scratch folder (tests/support/scratch.py), not the repo."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis.configuration import storage_directory

from tests.support import browser, matrix
from tests.support.scratch import ROOT, SCRATCH

pytestmark = pytest.mark.same_everywhere


def outside_the_checkout(path: Path | str) -> bool:
    return not Path(path).resolve().is_relative_to(ROOT)


def test_the_scratch_folder_is_outside_the_checkout() -> None:
    assert outside_the_checkout(SCRATCH)


def test_hypothesis_keeps_its_examples_in_the_scratch_folder() -> None:
    examples = storage_directory("examples", intent_to_write=False).path
    assert outside_the_checkout(examples)
    assert examples.resolve().is_relative_to(SCRATCH.resolve())


def test_the_browser_pictures_go_outside_the_checkout() -> None:
    assert outside_the_checkout(browser.SCREENSHOTS)


def test_a_matrix_leg_writes_its_reports_and_bytecode_outside_the_checkout(
    tmp_path: Path,
) -> None:
    seen: dict[str, Any] = {}

    def run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        seen["args"], seen["env"] = args, kwargs["env"]
        return subprocess.CompletedProcess(args, 0)

    leg = matrix.Leg(
        name="leg",
        key="leg",
        python=Path("python"),
        database="sqlite",
        settings_module="tests.settings",
        selection="",
        suffix="_leg",
        estimate=1,
    )
    base = {"db": "test_io", "namespace": "test_io"}
    with mock.patch.object(matrix.subprocess, "run", run):
        matrix.run_leg_in(leg, [], tmp_path, base, None)

    env = seen["env"]
    assert outside_the_checkout(env["PYTHONPYCACHEPREFIX"])
    assert outside_the_checkout(env["IO_TEST_SCRATCH"])
    assert outside_the_checkout(env["IO_TEST_SCREENSHOTS"])
    junit = next(a for a in seen["args"] if str(a).startswith("--junitxml="))
    assert outside_the_checkout(str(junit).removeprefix("--junitxml="))
    assert "no:cacheprovider" in seen["args"]
