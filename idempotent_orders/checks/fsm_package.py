"""Which package provides the module ``django_fsm`` (E004, W004).

django-fsm-2 and the original django-fsm both install ``django_fsm``; pip installs one
over the other without a word. See :mod:`idempotent_orders.fsm`.
"""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Tags, Warning, register

from idempotent_orders.fsm import ORIGINAL, Installed, installed

__all__ = ["check_fsm_package", "fsm_package_messages"]


@register(Tags.compatibility)
def check_fsm_package(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Both fsm distributions installed over each other, or the original one in use."""
    return fsm_package_messages(installed())


def fsm_package_messages(found: Installed) -> list[CheckMessage]:
    """The messages for what :func:`~idempotent_orders.fsm.installed` found."""
    if found.mixed:
        return [
            Error(
                f"The module django_fsm is half-overwritten ({found.describe()}). "
                "django-fsm-2 and the original django-fsm both install it; uninstalling "
                "either one now removes the files both share, and a redeploy installs "
                "them over each other again.",
                hint=f"Keep one, with its own files: {found.repair()}; and name only that "
                "one in your requirements.",
                id="idempotent_orders.E004",
            )
        ]
    if found.owner == ORIGINAL:
        return [
            Warning(
                f"The original django-fsm {found.versions[ORIGINAL]} provides django_fsm, "
                "not django-fsm-2 (which idempotent-orders requires, so pip check reports "
                "it missing). The app runs on it; the original is archived.",
                hint="Move to django-fsm-2, the maintained fork (same module, same names): "
                "pip uninstall -y django-fsm && pip install django-fsm-2. To stay on the "
                "original, add idempotent_orders.W004 to SILENCED_SYSTEM_CHECKS.",
                id="idempotent_orders.W004",
            )
        ]
    return []
