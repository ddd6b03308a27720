"""The ``Idempotency-Key`` header: parse, claim, lease, store and replay.

The public import path of the key's steps, which live one concept to a module
below :mod:`idempotent_orders.http.decorators` (which runs them around a view):
:mod:`~idempotent_orders.http.header` (parse, body, fingerprint),
:mod:`~idempotent_orders.http.principals`, :mod:`~idempotent_orders.http.claims`
(the claim; its SQL in :mod:`~idempotent_orders.http.claim_sql`),
:mod:`~idempotent_orders.http.lease` (lease and heartbeat),
:mod:`~idempotent_orders.http.replay` (store and replay) and
:mod:`~idempotent_orders.http.quotas`. Also the path of the deprecated
decorator aliases, which build on the decorators: kept here, this module above
both, so neither imports the other back. ``Claim`` is now :class:`KeyClaim`
(the old name warns, removed in 0.4.0).
"""

from __future__ import annotations

import warnings
from typing import Any

from idempotent_orders._moved import moved
from idempotent_orders.http.claims import KeyClaim, claim, purge_expired, release
from idempotent_orders.http.header import (
    HEADER,
    TOKEN_PREFIX,
    UNSAFE_METHODS,
    check_length,
    fingerprint,
    header_key,
    parse_key,
    read_body,
)
from idempotent_orders.http.lease import heartbeat, renew
from idempotent_orders.http.principals import (
    default_principal,
    get_principal,
    scope_of,
    stored_principal,
)
from idempotent_orders.http.quotas import forget_stale_bounds, lock_principal, raise_bound
from idempotent_orders.http.replay import replay, store

__all__ = [
    "HEADER",
    "TOKEN_PREFIX",
    "UNSAFE_METHODS",
    "KeyClaim",
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


_renamed = moved(__name__, renamed={"Claim": "idempotent_orders.http.claims.KeyClaim"})


def __getattr__(name: str) -> Any:
    # The mixin moved with the decorator; its old import path keeps working.
    if name == "IdempotentMixin":
        from idempotent_orders.http.decorators import IdempotentMixin

        return IdempotentMixin
    return _renamed(name)
