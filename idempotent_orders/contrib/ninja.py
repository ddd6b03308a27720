"""django-ninja support (the ``ninja`` extra): :func:`idempotent_operation`, sync or async.

Put it under the route decorator::

    @api.post("/orders", response={201: OrderOut})
    @idempotent_operation
    def create_order(request, payload: OrderIn): ...

The key is claimed around the operation's whole run (parameter parsing, ninja's
auth, the function and its response), with the semantics of
:func:`~idempotent_orders.http.idempotent_view`. The principal comes from
``PRINCIPAL_RESOLVER`` (Django's user, ``request.idempotency_client`` or the
session): ninja's own auth callbacks run after the claim.
"""

from __future__ import annotations

from typing import Any

from ninja.decorators import decorate_view

from idempotent_orders.http.decorators import OnFailure, idempotent_view

__all__ = ["idempotent_operation"]


def idempotent_operation(
    func: Any = None, *, required: bool = True, on_failure: OnFailure | None = None
) -> Any:
    """Run a ninja operation's unsafe requests once per ``Idempotency-Key``.

    ``required=False`` lets keyless requests run normally; ``on_failure`` is
    :func:`~idempotent_orders.http.idempotent_view`'s.
    """
    decorate = decorate_view(idempotent_view(required=required, on_failure=on_failure))
    return decorate(func) if func is not None else decorate
