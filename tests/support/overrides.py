"""Settings of the app changed for a test."""

from __future__ import annotations

from typing import Any

from django.test import override_settings

__all__ = ["settings_with"]


def settings_with(**values: Any) -> override_settings:
    """``IDEMPOTENT_ORDERS`` as the test settings have it, with ``values`` on top."""
    from django.conf import settings

    return override_settings(IDEMPOTENT_ORDERS={**settings.IDEMPOTENT_ORDERS, **values})
