"""Deprecated: the consumer's SQL moved to
:mod:`idempotent_orders.consuming.sql`.

This path answers with a ``DeprecationWarning`` and is removed in 0.4.0.
"""

from idempotent_orders._moved import moved

__getattr__ = moved(__name__, "idempotent_orders.consuming.sql")
