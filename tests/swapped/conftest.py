"""Fixtures of the two-texts road's tests on both databases."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django_fsm.signals import pre_transition

from idempotent_orders.consuming import registry


@pytest.fixture
def heard() -> Iterator[list[Any]]:
    """A ``pre_transition`` receiver on every order (the project's code runs): its calls."""
    calls: list[Any] = []

    def receive(sender: Any, instance: Any, **kwargs: Any) -> None:
        calls.append((instance.pk, kwargs["name"]))

    pre_transition.connect(receive, weak=False, dispatch_uid="test-claim-and-run")
    yield calls
    pre_transition.disconnect(dispatch_uid="test-claim-and-run")


@pytest.fixture
def pay_with_money() -> Iterator[None]:
    saved = dict(registry._registry)
    registry.register("flow.pay", transition="pay", money=True)
    yield
    registry._registry.clear()
    registry._registry.update(saved)
