"""The ``Idempotency-Key`` header: parse, claim, lease, store and replay.

The public import path of :mod:`idempotent_orders.http.claims`, where these
steps live (below :mod:`idempotent_orders.http.decorators`, which runs them
around a view), and of the deprecated decorator aliases, which build on the
decorators: kept here, this module above both, so neither imports the other
back.
"""

from __future__ import annotations

import warnings
from typing import Any

from idempotent_orders.http.claims import (
    HEADER,
    TOKEN_PREFIX,
    UNSAFE_METHODS,
    Claim,
    check_length,
    claim,
    default_principal,
    fingerprint,
    forget_stale_bounds,
    get_principal,
    header_key,
    heartbeat,
    lock_principal,
    parse_key,
    purge_expired,
    raise_bound,
    read_body,
    release,
    renew,
    replay,
    scope_of,
    store,
    stored_principal,
)

__all__ = [
    "HEADER",
    "TOKEN_PREFIX",
    "UNSAFE_METHODS",
    "Claim",
    "check_length",
    "claim",
    "default_principal",
    "fingerprint",
    "forget_stale_bounds",
    "get_principal",
    "header_key",
    "heartbeat",
    "lock_principal",
    "parse_key",
    "purge_expired",
    "raise_bound",
    "read_body",
    "release",
    "renew",
    "replay",
    "scope_of",
    "store",
    "stored_principal",
]


def idempotent(view: Any = None, *, required: bool = True) -> Any:
    """Deprecated: use :func:`idempotent_orders.http.idempotent_view` (removed in 0.3)."""
    from idempotent_orders.http.decorators import idempotent_view

    warnings.warn(
        "idempotent_orders.http.keys.idempotent is deprecated; "
        "use idempotent_orders.http.idempotent_view",
        DeprecationWarning,
        stacklevel=2,
    )
    return idempotent_view(view, required=required)


def __getattr__(name: str) -> Any:
    # The mixin moved with the decorator; its old import path keeps working.
    if name == "IdempotentMixin":
        from idempotent_orders.http.decorators import IdempotentMixin

        return IdempotentMixin
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
