"""One-time tokens: unguessable, bound to a principal, consumed atomically, quota-limited.

A token is an :class:`~idempotent_orders.models.IdempotencyKey` row in state
``issued``. Using it (as the ``Idempotency-Key`` header or the form field) is a
conditional ``UPDATE ... WHERE state='issued' AND principal=...``: exactly one
request wins it, and a token of another principal matches nothing.
"""

from __future__ import annotations

import secrets
from datetime import timedelta

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.http import HttpRequest
from django.utils import timezone

from idempotent_orders.conf import conf
from idempotent_orders.exceptions import NotAuthenticated, QuotaExceeded
from idempotent_orders.http.header import TOKEN_PREFIX
from idempotent_orders.http.principals import get_principal, scope_of, stored_principal
from idempotent_orders.http.quotas import lock_principal, raise_bound
from idempotent_orders.models import IdempotencyKey, KeyState

__all__ = ["get_token", "issue_token"]


def issue_token(principal: str, *, evict: bool = False) -> IdempotencyKey:
    """A new token for ``principal``.

    Past ``TOKEN_QUOTA`` unused tokens, raise :class:`QuotaExceeded`, or with
    ``evict`` drop the principal's oldest unused tokens (a page that renders a
    form must not fail because an old tab left tokens behind).
    """
    principal = stored_principal(principal)
    conn = connections[DEFAULT_DB_ALIAS]
    with transaction.atomic(using=conn.alias):
        # Counted and inserted under the principal's claim lock: the live-key
        # quota holds against concurrent claims, and so does its bound.
        lock_principal(conn, principal)
        now = timezone.now()
        unused = IdempotencyKey.objects.filter(
            principal=principal, state=KeyState.ISSUED, expires_at__gt=now
        )
        count = unused.count()
        if count >= conf.TOKEN_QUOTA:
            if not evict:
                raise QuotaExceeded(
                    f"you hold {count} unused tokens, the limit is {conf.TOKEN_QUOTA}",
                    retry_after=conf.RETRY_AFTER,
                )
            keep = max(conf.TOKEN_QUOTA - 1, 0)
            oldest = list(unused.order_by("-created_at", "-id").values_list("pk", flat=True)[keep:])
            IdempotencyKey.objects.filter(pk__in=oldest, state=KeyState.ISSUED).delete()
        live = IdempotencyKey.objects.filter(principal=principal, expires_at__gt=now).count()
        if live >= conf.KEY_QUOTA:
            raise QuotaExceeded(
                f"you hold {live} live keys and tokens, the limit is {conf.KEY_QUOTA}",
                retry_after=conf.RETRY_AFTER,
            )
        row = IdempotencyKey.objects.create(
            scope=scope_of(principal, "", ""),
            # 32 random bytes: unguessable, and unique without a retry loop.
            key=TOKEN_PREFIX + secrets.token_urlsafe(32),
            principal=principal,
            state=KeyState.ISSUED,
            is_token=True,
            expires_at=now + timedelta(seconds=conf.TOKEN_TTL),
        )
        raise_bound(conn, principal)
    return row


def get_token(request: HttpRequest) -> str:
    """A fresh token for the request's principal (the template tag calls this)."""
    principal = get_principal(request)
    if principal is None:
        raise NotAuthenticated("tokens need an authenticated caller or a session")
    return issue_token(principal, evict=True).key
