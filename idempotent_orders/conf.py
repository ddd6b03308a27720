"""Settings of idempotent_orders, read from ``settings.IDEMPOTENT_ORDERS`` on every access."""

from __future__ import annotations

from typing import Any

from django.conf import settings

#: Every setting with its default. ``settings.IDEMPOTENT_ORDERS`` overrides any of them.
DEFAULTS: dict[str, Any] = {
    # Envelope limits: larger or longer input is rejected with a reason.
    "MAX_MESSAGE_BYTES": 64 * 1024,
    "MAX_MESSAGE_ID_LENGTH": 255,
    # How long processed-message ids are kept (seconds). Must exceed the longest
    # time a broker can redeliver a message (checked by a system check).
    "DEDUP_RETENTION": 7 * 24 * 3600,
    # How many times a transition is re-decided after losing an optimistic-lock race.
    "CONFLICT_RETRIES": 50,
    # Enqueue the fulfilment task (paid -> processing) after a payment is applied.
    "FULFIL_AFTER_PAYMENT": True,
    # Celery retry budget for transient errors (lost connections, serialization failures).
    "TASK_MAX_RETRIES": 10,
    "TASK_RETRY_BACKOFF_MAX": 60,
}


class Settings:
    """Typed accessors; each property reads Django settings when it is used."""

    def _get(self, name: str) -> Any:
        user = getattr(settings, "IDEMPOTENT_ORDERS", None) or {}
        return user.get(name, DEFAULTS[name])

    @property
    def MAX_MESSAGE_BYTES(self) -> int:
        return int(self._get("MAX_MESSAGE_BYTES"))

    @property
    def MAX_MESSAGE_ID_LENGTH(self) -> int:
        return int(self._get("MAX_MESSAGE_ID_LENGTH"))

    @property
    def DEDUP_RETENTION(self) -> int:
        return int(self._get("DEDUP_RETENTION"))

    @property
    def CONFLICT_RETRIES(self) -> int:
        return int(self._get("CONFLICT_RETRIES"))

    @property
    def FULFIL_AFTER_PAYMENT(self) -> bool:
        return bool(self._get("FULFIL_AFTER_PAYMENT"))

    @property
    def TASK_MAX_RETRIES(self) -> int:
        return int(self._get("TASK_MAX_RETRIES"))

    @property
    def TASK_RETRY_BACKOFF_MAX(self) -> int:
        return int(self._get("TASK_RETRY_BACKOFF_MAX"))


conf = Settings()
