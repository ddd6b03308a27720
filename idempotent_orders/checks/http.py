"""Checks of the ``Idempotency-Key`` settings: ones that cannot work (E021-E024, W020)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

__all__ = ["check_http_settings"]


@register(Tags.compatibility)
def check_http_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Idempotency-Key settings that cannot work (E020-E029, W020-W029)."""
    from django.utils.module_loading import import_string

    from idempotent_orders.conf import conf

    user = getattr(settings, "IDEMPOTENT_ORDERS", {})
    if not isinstance(user, dict):
        return []  # E001 reports it
    messages: list[CheckMessage] = []
    length = user.get("KEY_MAX_LENGTH")
    if isinstance(length, int) and length > 255:
        messages.append(
            Error(
                "IDEMPOTENT_ORDERS['KEY_MAX_LENGTH'] is at most 255 (the column size).",
                id="idempotent_orders.E021",
            )
        )
    path = user.get("PRINCIPAL_RESOLVER")
    if isinstance(path, str):
        try:
            resolver = import_string(path)
        except ImportError:
            resolver = None
        if not callable(resolver):
            messages.append(
                Error(
                    f"IDEMPOTENT_ORDERS['PRINCIPAL_RESOLVER'] {path!r} is not an importable "
                    "callable.",
                    id="idempotent_orders.E022",
                )
            )
    ttl, lease = user.get("KEY_TTL"), user.get("KEY_LEASE")
    if isinstance(ttl, int) and isinstance(lease, int) and 0 < ttl <= lease:
        messages.append(
            Error(
                "IDEMPOTENT_ORDERS['KEY_TTL'] must exceed KEY_LEASE, or keys expire in flight.",
                id="idempotent_orders.E023",
            )
        )
    if isinstance(user.get("REPLAY_HEADERS"), list) and any(
        str(h).lower() == "set-cookie" for h in conf.REPLAY_HEADERS
    ):
        messages.append(
            Error(
                "IDEMPOTENT_ORDERS['REPLAY_HEADERS'] must not contain Set-Cookie: a replay "
                "would hand one session's cookie to whoever holds the key.",
                id="idempotent_orders.E024",
            )
        )
    middleware = list(getattr(settings, "MIDDLEWARE", []))
    if "django.contrib.sessions.middleware.SessionMiddleware" not in middleware:
        messages.append(
            Warning(
                "SessionMiddleware is not installed: anonymous callers have no principal, "
                "so idempotent views and {% idempotency_token %} answer them 401.",
                id="idempotent_orders.W020",
            )
        )
    return messages
