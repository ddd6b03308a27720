"""A principal's quota of live keys (``KEY_QUOTA``): counted, bounded, serialized.

A claim inserts its key only while the principal holds fewer than
``KEY_QUOTA`` live keys (the guard is in the claim's SQL,
:mod:`idempotent_orders.http.claim_sql`). The principal's claims are serialized
around that guard, so it is exact under concurrency; on PostgreSQL a
:class:`~idempotent_orders.models.KeyQuota` bound spares counting the keys
until it reaches the quota. Tokens inserted outside a claim raise the bound
under the same lock.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from idempotent_orders.conf import conf
from idempotent_orders.models import IdempotencyKey, KeyQuota
from idempotent_orders.vendors import vendor

__all__ = ["forget_stale_bounds", "live_keys", "lock_id", "lock_principal", "raise_bound"]


def live_keys(principal: str, now: Any) -> int:
    """How many keys of ``principal`` (as stored) have not expired at ``now``."""
    return IdempotencyKey.objects.filter(principal=principal, expires_at__gt=now).count()


def lock_id(principal: str) -> int:
    """A signed 64-bit advisory lock id for ``principal`` (PostgreSQL)."""
    digest = hashlib.sha256(b"idempotent_orders.quota\n" + principal.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def forget_stale_bounds(*, now: Any = None) -> int:
    """Delete the quota bounds no claim has raised for ``KEY_TTL`` (their keys have expired).

    Always safe: a principal without a bound has its live keys counted at its
    next claim, which sets a new bound.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=conf.KEY_TTL)
    deleted, _ = KeyQuota.objects.filter(updated_at__lt=cutoff).delete()
    return deleted


def raise_bound(conn: BaseDatabaseWrapper, principal: str) -> None:
    """Count one more live key for ``principal`` in its quota bound, if it has one
    (PostgreSQL); ``principal`` as stored
    (:func:`~idempotent_orders.http.principals.stored_principal`).

    For keys inserted outside a claim (tokens), in their inserting transaction,
    which must hold the principal's claim lock (:func:`lock_principal`).
    """
    if vendor(conn).claim_lock == "advisory":  # the claims keep bounds (claim_sql)
        qn = conn.ops.quote_name
        with conn.cursor() as cursor:
            cursor.execute(
                f"UPDATE {qn(KeyQuota._meta.db_table)} SET {qn('bound')} = {qn('bound')} + 1,"
                f" {qn('updated_at')} = now() WHERE {qn('principal')} = %s",
                [principal],
            )


def lock_principal(conn: BaseDatabaseWrapper, principal: str) -> None:
    """Serialize with ``principal``'s claims until the transaction ends (PostgreSQL);
    ``principal`` as stored (:func:`~idempotent_orders.http.principals.stored_principal`).
    """
    vendor(conn).lock_until_commit(conn, lock_id(principal))
