"""The test settings with idempotent_orders' migrations as released in 0.1.0."""

from __future__ import annotations

from tests.settings import *  # noqa: F403

MIGRATION_MODULES = {"idempotent_orders": "tests.upgrade.migrations"}
