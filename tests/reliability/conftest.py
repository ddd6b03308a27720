"""Reliability suites: Hypothesis profiles and the opt-in for the long chaos run."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

# `make test` runs a bounded search; `make chaos` sets IO_HYPOTHESIS_PROFILE=chaos.
# The bounded search reports a failing example as found: shrinking examples that each
# talk to the database takes minutes. `make chaos` (or IO_HYPOTHESIS_SHRINK=1) shrinks.
_SHRINK = os.environ.get("IO_HYPOTHESIS_SHRINK") == "1"
settings.register_profile(
    "default",
    max_examples=int(os.environ.get("IO_HYPOTHESIS_EXAMPLES", "25")),
    phases=[phase for phase in Phase if _SHRINK or phase is not Phase.shrink],
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "chaos",
    max_examples=int(os.environ.get("IO_HYPOTHESIS_EXAMPLES", "400")),
    # Every phase, explicitly: a profile inherits from the one loaded (the default above).
    phases=list(Phase),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("IO_HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The long chaos run takes many minutes: it runs under `make chaos` (IO_CHAOS_LONG=1
    # or `-m slow`), never by accident inside the normal suite.
    if os.environ.get("IO_CHAOS_LONG") == "1" or "slow" in (config.option.markexpr or ""):
        return
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.skip(reason="long run: `make chaos` (IO_CHAOS_LONG=1)"))
