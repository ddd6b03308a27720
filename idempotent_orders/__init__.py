"""Idempotent order workflows for Django."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from idempotent_orders.models import AbstractOrder

__version__ = "0.1.0"
__all__ = ["get_order_model"]


#: The order model once the app registry is ready (forgotten when the setting naming it,
#: or the installed apps, change: see conf.py): the consumers ask for it on every message.
_found: type[AbstractOrder] | None = None


def get_order_model() -> type[AbstractOrder]:
    """The order model in use: ``settings.IDEMPOTENT_ORDERS_ORDER_MODEL`` (default
    ``"idempotent_orders.Order"``), as ``get_user_model()`` is for the user.
    """
    global _found
    if _found is not None:
        return _found
    from django.apps import apps
    from django.core.exceptions import ImproperlyConfigured

    from idempotent_orders.conf import ORDER_MODEL_SETTING, order_model_label, order_model_listeners

    label = order_model_label()
    try:
        model = apps.get_model(label, require_ready=False)
    except ValueError:
        raise ImproperlyConfigured(
            f"{ORDER_MODEL_SETTING} must be of the form 'app_label.ModelName', not {label!r}"
        ) from None
    except LookupError:
        raise ImproperlyConfigured(
            f"{ORDER_MODEL_SETTING} refers to model {label!r}, which is not installed"
        ) from None
    if apps.ready:
        if _forget_order_model not in order_model_listeners:
            order_model_listeners.append(_forget_order_model)
        _found = model
    return model


def _forget_order_model() -> None:
    """Look the order model up again on the next call (the settings or apps changed)."""
    global _found
    _found = None
