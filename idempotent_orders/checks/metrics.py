"""System checks of the metrics view: who may read ``/metrics``, and the multiprocess directory.

Registered with Django's check framework when this module is imported
(:mod:`idempotent_orders.checks` imports it).
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

#: A bearer token shorter than this is refused by the check (it could be guessed).
MIN_TOKEN_LENGTH = 16


def _user_settings() -> dict[str, Any]:
    user = getattr(settings, "IDEMPOTENT_ORDERS", None)
    return user if isinstance(user, dict) else {}


def _metrics_view_routed() -> bool:
    """Whether the root URLconf routes a URL to ``metrics_view`` (outside namespaces)."""
    try:
        from django.urls import get_resolver

        from idempotent_orders.observability import metrics_view

        return metrics_view in get_resolver().reverse_dict
    except Exception:  # an URLconf that does not import is reported by Django itself
        return False


@register(Tags.security)
def check_metrics_access(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The METRICS_* settings hold a usable token and addresses; a routed view is reachable."""
    user = _user_settings()
    found: list[CheckMessage] = []
    token = user.get("METRICS_TOKEN", "")
    if isinstance(token, str) and token and len(token) < MIN_TOKEN_LENGTH:
        found.append(
            Error(
                f"settings.IDEMPOTENT_ORDERS['METRICS_TOKEN'] is {len(token)} characters long;"
                f" a bearer token needs at least {MIN_TOKEN_LENGTH}.",
                hint="Use e.g. secrets.token_urlsafe(32), read from the environment.",
                id="idempotent_orders.E090",
            )
        )
    allowed = user.get("METRICS_ALLOW_IPS", [])
    if isinstance(allowed, list):
        for entry in allowed:
            try:
                ipaddress.ip_network(str(entry), strict=False)
            except ValueError:
                found.append(
                    Error(
                        f"settings.IDEMPOTENT_ORDERS['METRICS_ALLOW_IPS'] holds {entry!r},"
                        " which is neither an IP address nor a network.",
                        hint='Write addresses or networks: "10.0.0.7", "10.0.0.0/8", "::1".',
                        id="idempotent_orders.E091",
                    )
                )
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory and not (os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)):
        found.append(
            Error(
                f"PROMETHEUS_MULTIPROC_DIR is {directory!r}, which is not a writable directory:"
                " the processes cannot keep their metrics there.",
                hint="Create it (empty) before gunicorn or the Celery worker starts.",
                id="idempotent_orders.E092",
            )
        )
    closed = not (token or allowed or user.get("METRICS_PUBLIC"))
    if closed and not settings.DEBUG and _metrics_view_routed():
        found.append(
            Warning(
                "The metrics view is routed but refuses every request: no METRICS_TOKEN,"
                " METRICS_ALLOW_IPS or METRICS_PUBLIC is set (it is open only under DEBUG).",
                hint="Give the scraper a bearer token (METRICS_TOKEN) or allow its addresses.",
                id="idempotent_orders.W090",
            )
        )
    return found
