"""Whose key it is: the principal of a request, as resolved, stored and scoped.

A key belongs to a principal (``user:<pk>``, ``client:<id>`` or
``session:<key>``, through the ``PRINCIPAL_RESOLVER`` setting) and is scoped
to that principal, the method and the route. An anonymous caller's new
sessions are rate-limited per client IP.
"""

from __future__ import annotations

import functools
import hashlib
import time
from typing import Any

from django.http import HttpRequest
from django.utils.module_loading import import_string

from idempotent_orders.conf import conf
from idempotent_orders.exceptions import TooManySessions
from idempotent_orders.http.header import UNSAFE_METHODS

__all__ = ["default_principal", "get_principal", "scope_of", "stored_principal"]


def default_principal(request: HttpRequest) -> str | None:
    """``user:<pk>``, ``client:<id>`` (set by an API-client auth layer) or ``session:<key>``.

    An anonymous caller's principal is its session. A page load (a safe method:
    the template tag minting a form's token) creates one if needed, at most
    ``SESSION_RATE`` per client IP per ``SESSION_RATE_WINDOW`` seconds (then
    :class:`TooManySessions`, 429). An unsafe request without a session gets
    none (a new session per request would make every retry a new principal,
    its key protecting nothing): it has no principal, and its key answers 401
    ``session-required``. Without the session middleware there is no principal.
    """
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    client = getattr(request, "idempotency_client", None)
    if client:
        return f"client:{client}"
    session = getattr(request, "session", None)
    if session is None:
        return None
    if not session.session_key:
        if request.method in UNSAFE_METHODS:
            return None
        _count_new_session(request)
        session.save()
        session.modified = True  # so the middleware sends the new session's cookie
    return f"session:{session.session_key}"


def _count_new_session(request: HttpRequest) -> None:
    """Count a new anonymous session against its client IP; raise past ``SESSION_RATE``.

    The count lives in the ``LOCK_CACHE`` cache, one fixed window per address
    (``REMOTE_ADDR``: behind a proxy, set it from the proxy's header first).
    """
    from django.core.cache import caches

    window = conf.SESSION_RATE_WINDOW
    address = request.META.get("REMOTE_ADDR") or "unknown"
    slot = int(time.time()) // window
    name = f"idempotent_orders:sessions:{hashlib.sha256(address.encode()).hexdigest()[:32]}:{slot}"
    cache = caches[conf.LOCK_CACHE]
    cache.add(name, 0, timeout=window + 1)
    try:
        count = cache.incr(name)
    except ValueError:  # expired between add and incr
        cache.add(name, 1, timeout=window + 1)
        count = 1
    if count > conf.SESSION_RATE:
        retry_after = max(1, (slot + 1) * window - int(time.time()))
        raise TooManySessions(
            f"{address} started more than {conf.SESSION_RATE} sessions in {window} seconds;"
            " send back the session cookie you were given, or wait",
            retry_after=retry_after,
        )


@functools.lru_cache(maxsize=8)
def _resolver(path: str) -> Any:
    return import_string(path)


def get_principal(request: HttpRequest) -> str | None:
    """The principal of ``request`` through the ``PRINCIPAL_RESOLVER`` setting."""
    cached = getattr(request, "_idempotency_principal", None)
    if cached is not None:
        return str(cached)
    principal = _resolver(conf.PRINCIPAL_RESOLVER)(request)
    if principal is not None:
        principal = str(principal)  # whole: see stored_principal for its column
        request._idempotency_principal = principal  # type: ignore[attr-defined]
    return principal


#: The longest principal stored as it is (the ``principal`` columns hold 191 characters).
_PRINCIPAL_KEPT = 190


def stored_principal(principal: str) -> str:
    """``principal`` as its keys, tokens and quota bound store it (at most 191 characters).

    A principal of up to 190 characters is stored as it is; a longer one as its
    first 126 characters (to read), ``#`` and the SHA-256 of the whole, exactly
    191 characters, so no two principals share a stored value: two API clients
    whose ids differ past any prefix get neither each other's keys, nor tokens,
    nor quota.
    """
    if len(principal) <= _PRINCIPAL_KEPT:
        return principal
    digest = hashlib.sha256(principal.encode()).hexdigest()
    return f"{principal[: _PRINCIPAL_KEPT - len(digest)]}#{digest}"


def scope_of(principal: str, method: str, route: str) -> str:
    """The scope of a key: a SHA-256 over the whole ``principal``, ``method`` and ``route``."""
    return hashlib.sha256(f"{principal}\n{method}\n{route}".encode()).hexdigest()
