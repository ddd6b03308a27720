"""Deprecated alias of :mod:`idempotent_orders.contrib.drf` (removed in 0.3)."""

import warnings

from idempotent_orders.contrib.drf import IdempotentAPIViewMixin

__all__ = ["IdempotentAPIViewMixin"]

warnings.warn(
    "idempotent_orders.http.drf is deprecated; "
    "import IdempotentAPIViewMixin from idempotent_orders.contrib.drf",
    DeprecationWarning,
    stacklevel=2,
)
