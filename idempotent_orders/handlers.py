"""Deprecated: the registry of message types moved to
:mod:`idempotent_orders.consuming.registry`.

This path answers with a ``DeprecationWarning`` and is removed in 0.4.0.
"""

from idempotent_orders._moved import moved

__getattr__ = moved(__name__, "idempotent_orders.consuming.registry")
