"""The ``Idempotency-Key`` header: parse, claim, lease, store and replay.

The public import path of the key's steps, which live one concept to a module
below :mod:`idempotent_orders.http.decorators` (which runs them around a view):
:mod:`~idempotent_orders.http.header` (parse, body, fingerprint),
:mod:`~idempotent_orders.http.principals`, :mod:`~idempotent_orders.http.claims`
(the claim; its SQL in :mod:`~idempotent_orders.http.claim_sql`),
:mod:`~idempotent_orders.http.lease` (lease and heartbeat),
:mod:`~idempotent_orders.http.replay` (store and replay) and
:mod:`~idempotent_orders.http.quotas`.
"""

from __future__ import annotations

from idempotent_orders.http.claims import claim, purge_expired, release
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
from idempotent_orders.http.lease import KeyClaim, heartbeat, renew
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
