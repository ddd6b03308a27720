"""System checks with stable IDs (``idempotent_orders.E0xx`` / ``W0xx``)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, register

from idempotent_orders.conf import DEFAULTS


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """IDEMPOTENT_ORDERS must be a dict of known names with values of the right type."""
    errors: list[CheckMessage] = []
    user = getattr(settings, "IDEMPOTENT_ORDERS", {})
    if not isinstance(user, dict):
        return [
            Error(
                "settings.IDEMPOTENT_ORDERS must be a dict.",
                id="idempotent_orders.E001",
            )
        ]
    for name, value in user.items():
        if name not in DEFAULTS:
            errors.append(
                Error(
                    f"settings.IDEMPOTENT_ORDERS has an unknown key {name!r}.",
                    hint=f"Known keys: {', '.join(sorted(DEFAULTS))}.",
                    id="idempotent_orders.E002",
                )
            )
            continue
        expected = type(DEFAULTS[name])
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            errors.append(
                Error(
                    f"settings.IDEMPOTENT_ORDERS[{name!r}] must be {expected.__name__}, "
                    f"got {type(value).__name__}.",
                    id="idempotent_orders.E003",
                )
            )
    return errors


@register(Tags.compatibility, Tags.caches)
def check_outbox_and_locks(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The lock cache exists; outbox sizes and times are positive."""
    user = getattr(settings, "IDEMPOTENT_ORDERS", {})
    if not isinstance(user, dict):
        return []  # E001 already reports it
    errors: list[CheckMessage] = []
    alias = user.get("LOCK_CACHE", DEFAULTS["LOCK_CACHE"])
    if isinstance(alias, str) and alias not in getattr(settings, "CACHES", {}):
        errors.append(
            Error(
                f"IDEMPOTENT_ORDERS['LOCK_CACHE'] is {alias!r}, which is not in settings.CACHES.",
                hint="Point it at a django-redis cache alias.",
                id="idempotent_orders.E080",
            )
        )
    for name in (
        "OUTBOX_BATCH_SIZE",
        "OUTBOX_CLAIM_TIMEOUT",
        "OUTBOX_RETENTION",
        "OUTBOX_RETRY_BACKOFF_MAX",
    ):
        value = user.get(name, DEFAULTS[name])
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            errors.append(
                Error(
                    f"IDEMPOTENT_ORDERS[{name!r}] must be at least 1, got {value}.",
                    id="idempotent_orders.E081",
                )
            )
    return errors


@register(Tags.compatibility, Tags.caches)
def check_dedup(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The fast-path layers need a cache that exists and sane Bloom sizes and windows."""
    from django.core.checks import Warning

    from idempotent_orders.conf import conf

    user = getattr(settings, "IDEMPOTENT_ORDERS", {})
    if not isinstance(user, dict):
        return []  # E001 already
    try:
        alias = conf.DEDUP_CACHE_ALIAS
        numbers = {
            "DEDUP_WINDOW": conf.DEDUP_WINDOW,
            "DEDUP_BLOOM_CAPACITY": conf.DEDUP_BLOOM_CAPACITY,
            "DEDUP_BLOOM_BUCKET_SECONDS": conf.DEDUP_BLOOM_BUCKET_SECONDS,
            "PARKED_TIMEOUT": conf.PARKED_TIMEOUT,
        }
        error_rate = conf.DEDUP_BLOOM_ERROR_RATE
    except (TypeError, ValueError):
        return []  # E003 already
    errors: list[CheckMessage] = []
    caches = getattr(settings, "CACHES", {})
    if alias and alias not in caches:
        errors.append(
            Error(
                f"IDEMPOTENT_ORDERS['DEDUP_CACHE_ALIAS'] is {alias!r}, which is not in CACHES.",
                hint='Name a django-redis cache, or set it to "" to switch the Redis layer off.',
                id="idempotent_orders.E010",
            )
        )
    elif alias and "django_redis" not in str(caches[alias].get("BACKEND", "")):
        errors.append(
            Warning(
                f"The dedup cache {alias!r} is not a django-redis cache.",
                hint="Other backends work but are usually per process or lossy, so most "
                "duplicates reach the database; counters then stay per process.",
                id="idempotent_orders.W010",
            )
        )
    for name, value in numbers.items():
        if value <= 0:
            errors.append(
                Error(
                    f"IDEMPOTENT_ORDERS[{name!r}] must be positive, got {value}.",
                    id="idempotent_orders.E011",
                )
            )
    if not 0 < error_rate < 1:
        errors.append(
            Error(
                "IDEMPOTENT_ORDERS['DEDUP_BLOOM_ERROR_RATE'] must be between 0 and 1 "
                f"(exclusive), got {error_rate}.",
                id="idempotent_orders.E012",
            )
        )
    return errors
