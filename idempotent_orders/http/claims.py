"""The claim on an ``Idempotency-Key``: taken, taken over, released, purged.

A request carrying a key runs like this (:mod:`idempotent_orders.http.decorators`
runs the steps around a view, sync or async):

1. The key is parsed and the request fingerprinted
   (:mod:`~idempotent_orders.http.header`); the key is scoped to the principal,
   method and route (:mod:`~idempotent_orders.http.principals`).
2. The key is *claimed* here, in its own committed statement (an ``INSERT``
   whose unique index decides the race, guarded by the principal's quota:
   :mod:`~idempotent_orders.http.claim_sql`, :mod:`~idempotent_orders.http.quotas`;
   or a conditional ``UPDATE`` of an issued token), so concurrent requests see
   it before the view runs. The view is exempted from ``ATOMIC_REQUESTS`` for
   this and runs in its own ``transaction.atomic()`` when the database asks for
   atomic requests.
3. While the view runs, the claim's lease is renewed
   (:mod:`~idempotent_orders.http.lease`), so a slow view is never run twice; a
   crashed one is taken over here once its lease expires. A holder that lost
   its lease never stores, and in a transaction rolls its view back.
4. The response is stored and replayed to retries
   (:mod:`~idempotent_orders.http.replay`). A 5xx or an exception releases the
   key so the client may retry.

Import the public names from :mod:`idempotent_orders.http.keys`.
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

from django.utils import timezone

from idempotent_orders.conf import conf
from idempotent_orders.exceptions import KeyInFlight, KeyMismatch, QuotaExceeded, TokenInvalid
from idempotent_orders.http.claim_sql import insert_claim
from idempotent_orders.http.header import TOKEN_PREFIX
from idempotent_orders.http.lease import KeyClaim, alive, lease_live, lease_values
from idempotent_orders.http.principals import scope_of, stored_principal
from idempotent_orders.http.quotas import forget_stale_bounds, live_keys
from idempotent_orders.models import IdempotencyKey, KeyState

__all__ = ["claim", "purge_expired", "release"]


def claim(
    *,
    principal: str,
    key: str,
    method: str,
    route: str,
    fingerprint: str,
    is_form: bool = False,
) -> KeyClaim | IdempotencyKey:
    """Claim ``key`` for this request, or return the completed row to replay.

    Each statement commits on its own (callers run outside any transaction):
    the claim must be visible to concurrent requests while the view runs.
    """
    now = timezone.now()
    owner = secrets.token_hex(16)
    scope = scope_of(principal, method, route)  # the whole principal
    holder = stored_principal(principal)
    lease = now + timedelta(seconds=conf.KEY_LEASE)
    if key.startswith(TOKEN_PREFIX):
        taken = IdempotencyKey.objects.filter(
            principal=holder,
            key=key,
            is_token=True,
            state=KeyState.ISSUED,
            expires_at__gt=now,
        ).update(
            state=KeyState.IN_FLIGHT,
            scope=scope,
            method=method,
            route=route[:255],
            fingerprint=fingerprint,
            lease_owner=owner,
            lease_expires_at=lease,
            expires_at=now + timedelta(seconds=conf.KEY_TTL),
        )
        if taken:
            return KeyClaim(IdempotencyKey.objects.get(scope=scope, key=key), owner)
        row = IdempotencyKey.objects.filter(alive(now), scope=scope, key=key).first()
        if row is None:
            raise TokenInvalid(
                "this token was not issued to you, has expired, or was used on another route"
            )
        return _decide(row, fingerprint, owner)
    if is_form:
        raise TokenInvalid("forms need a token rendered by {% idempotency_token %}")
    fields = {
        "scope": scope,
        "key": key,
        "principal": holder,
        "method": method,
        "route": route[:255],
        "fingerprint": fingerprint,
        "state": KeyState.IN_FLIGHT,
        "lease_owner": owner,
        "lease_expires_at": lease,
        "expires_at": now + timedelta(seconds=conf.KEY_TTL),
    }
    for _attempt in range(5):
        found = insert_claim(fields, now)
        if isinstance(found, int):
            return KeyClaim(IdempotencyKey(pk=found, **fields), owner)
        row = found or IdempotencyKey.objects.filter(scope=scope, key=key).first()
        if row is not None and row.expires_at <= now and not lease_live(row, now):
            # An expired key is forgotten, as if purged; the purge command does it in
            # bulk. Never a claim whose lease is live: its view is still running.
            IdempotencyKey.objects.filter(pk=row.pk).exclude(alive(now)).delete()
            continue
        if row is not None:
            return _decide(row, fingerprint, owner)
        live = live_keys(holder, now)
        if live >= conf.KEY_QUOTA:
            raise QuotaExceeded(
                f"you hold {live} live idempotency keys, the limit is {conf.KEY_QUOTA}",
                retry_after=conf.RETRY_AFTER,
            )
        # The key was released or purged between the insert and the look-up: again.
    raise KeyInFlight("the key is contended; retry", retry_after=conf.RETRY_AFTER)


def _decide(row: IdempotencyKey, fingerprint: str, owner: str) -> KeyClaim | IdempotencyKey:
    if row.fingerprint != fingerprint:
        raise KeyMismatch("this key was first used with a different request (method, path or body)")
    if row.state == KeyState.COMPLETED:
        return row
    now = timezone.now()
    if row.lease_expires_at is not None and row.lease_expires_at <= now:
        # The holder stopped heart-beating (it crashed): take the key over.
        taken = IdempotencyKey.objects.filter(
            pk=row.pk, state=KeyState.IN_FLIGHT, lease_owner=row.lease_owner
        ).update(lease_owner=owner, **lease_values(now + timedelta(seconds=conf.KEY_LEASE)))
        if taken:
            row.lease_owner = owner
            return KeyClaim(row, owner)
    raise KeyInFlight(
        "a request with this key is still being processed", retry_after=conf.RETRY_AFTER
    )


def release(held: KeyClaim) -> None:
    """Give the key back (5xx, exception, invalid form): the client may retry with it."""
    row = held.row
    mine = IdempotencyKey.objects.filter(pk=row.pk, lease_owner=held.owner)
    if row.is_token:
        mine.update(
            state=KeyState.ISSUED,
            scope=scope_of(row.principal, "", ""),
            method="",
            route="",
            fingerprint="",
            lease_owner="",
            lease_expires_at=None,
            expires_at=timezone.now() + timedelta(seconds=conf.TOKEN_TTL),
        )
    else:
        mine.delete()


def purge_expired(*, now: Any = None) -> int:
    """Delete expired keys and tokens (not a claim whose lease is still live)."""
    now = now or timezone.now()
    deleted, _ = (
        IdempotencyKey.objects.filter(expires_at__lte=now)
        .exclude(state=KeyState.IN_FLIGHT, lease_expires_at__gt=now)
        .delete()
    )
    forget_stale_bounds(now=now)
    return deleted
