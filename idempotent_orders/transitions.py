"""Deprecated: the fsm-2 graph and running a transition moved to
:mod:`idempotent_orders.consuming.graph`, :mod:`idempotent_orders.consuming.running`.

This path answers with a ``DeprecationWarning`` and is removed in 0.4.0.
"""

from idempotent_orders._moved import moved

__getattr__ = moved(
    __name__, "idempotent_orders.consuming.graph", "idempotent_orders.consuming.running"
)
