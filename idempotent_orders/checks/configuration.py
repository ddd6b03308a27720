"""Checks of ``settings.IDEMPOTENT_ORDERS`` itself: known names, right types, sane values.

E001-E003 (a dict of known names, each of its setting's type), E035 (dotted
paths import), E036 (every setting of ``conf.POSITIVE`` is positive), E037 (message
ids fit the inbox's column), W030 and W037 (pairs of settings that contradict each
other). :func:`well_typed` lets
the other checks skip a setting E003 already reports.
"""

from __future__ import annotations

from typing import Any, get_origin, get_type_hints

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

from idempotent_orders.conf import DEFAULTS, POSITIVE, Settings

__all__ = [
    "DOTTED_PATH_SETTINGS",
    "accepts",
    "check_setting_values",
    "check_settings",
    "setting_type",
    "user_settings",
    "well_typed",
]

#: Settings holding a dotted path that must import (checked by E035).
DOTTED_PATH_SETTINGS = ("FULFILMENT_CLIENT", "FULFILMENT_VERIFIER")


def setting_type(name: str) -> type:
    """The type ``conf`` reads setting ``name`` as: its typed property's return annotation."""
    hint = get_type_hints(getattr(Settings, name).fget)["return"]
    return get_origin(hint) or hint


def accepts(name: str, value: Any) -> bool:
    """Whether ``value`` has the type of setting ``name`` (a float setting takes an int too)."""
    expected = setting_type(name)
    if isinstance(value, bool) and expected is not bool:
        return False
    if expected is float:
        return isinstance(value, int | float)
    return isinstance(value, expected)


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
        if not accepts(name, value):
            errors.append(
                Error(
                    f"settings.IDEMPOTENT_ORDERS[{name!r}] must be {setting_type(name).__name__}, "
                    f"got {type(value).__name__}.",
                    id="idempotent_orders.E003",
                )
            )
    return errors


def user_settings() -> dict[str, Any]:
    """``settings.IDEMPOTENT_ORDERS`` as the project set it ({} when it is not a dict: E001)."""
    user = getattr(settings, "IDEMPOTENT_ORDERS", {})
    return user if isinstance(user, dict) else {}


def well_typed(name: str) -> bool:
    """Whether setting ``name`` is unset or of its type (else E003 reports it)."""
    user = user_settings()
    if name not in user:
        return True
    return accepts(name, user[name])


@register(Tags.compatibility)
def check_setting_values(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Values of the right type must also make sense: paths import, numbers are positive."""
    from django.utils.module_loading import import_string

    from idempotent_orders.conf import conf

    errors: list[CheckMessage] = []
    for name in DOTTED_PATH_SETTINGS:
        if not well_typed(name):
            continue  # E003 says so already
        path = getattr(conf, name)
        try:
            import_string(path)
        except ImportError as exc:
            errors.append(
                Error(
                    f"settings.IDEMPOTENT_ORDERS[{name!r}] = {path!r} cannot be imported: {exc}",
                    id="idempotent_orders.E035",
                )
            )
    for name in sorted(POSITIVE):
        if well_typed(name) and (value := getattr(conf, name)) <= 0:
            errors.append(
                Error(
                    f"settings.IDEMPOTENT_ORDERS[{name!r}] must be positive, "
                    f"got {user_settings().get(name, value)!r}.",
                    id="idempotent_orders.E036",
                )
            )
    if (
        well_typed("LEASE_SECONDS")
        and well_typed("HEARTBEAT_SECONDS")
        and conf.HEARTBEAT_SECONDS * 2 > conf.LEASE_SECONDS
    ):
        errors.append(
            Warning(
                "HEARTBEAT_SECONDS is more than half of LEASE_SECONDS: one slow heartbeat "
                "lets a live lease expire and the reconciler take the work over.",
                hint="Make HEARTBEAT_SECONDS at most a third of LEASE_SECONDS.",
                id="idempotent_orders.W030",
            )
        )
    if well_typed("MAX_MESSAGE_ID_LENGTH"):
        from idempotent_orders.models import ProcessedMessage

        column = ProcessedMessage._meta.get_field("message_id").max_length or 0
        if column < conf.MAX_MESSAGE_ID_LENGTH:
            errors.append(
                Error(
                    f"settings.IDEMPOTENT_ORDERS['MAX_MESSAGE_ID_LENGTH'] is "
                    f"{conf.MAX_MESSAGE_ID_LENGTH}, longer than the inbox's message_id "
                    f"column ({column}): an id the consumer and the webhook endpoint "
                    "accept would fail when stored.",
                    hint=f"Keep it at most {column}.",
                    id="idempotent_orders.E037",
                )
            )
    if (
        well_typed("PARKED_ATTENTION_AFTER")
        and well_typed("PARKED_TIMEOUT")
        and conf.PARKED_ATTENTION_AFTER > conf.PARKED_TIMEOUT
    ):
        errors.append(
            Warning(
                "PARKED_ATTENTION_AFTER is longer than PARKED_TIMEOUT: the admin's dashboard "
                "shows a held message only after it was already marked overdue.",
                hint="Make PARKED_ATTENTION_AFTER a few minutes, shorter than PARKED_TIMEOUT.",
                id="idempotent_orders.W037",
            )
        )
    return errors
