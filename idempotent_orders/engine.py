"""Deprecated: the envelope and the decision moved to
:mod:`idempotent_orders.consuming.envelope`, :mod:`idempotent_orders.consuming.decision`
and :mod:`idempotent_orders.consuming.failures`.

This path answers with a ``DeprecationWarning`` and is removed in 0.4.0.
"""

from idempotent_orders._moved import moved

__getattr__ = moved(
    __name__,
    "idempotent_orders.consuming.envelope",
    "idempotent_orders.consuming.decision",
    "idempotent_orders.consuming.failures",
)
