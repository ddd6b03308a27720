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
    # HTTP idempotency (Idempotency-Key header, one-time tokens, forms).
    # Longest accepted key (at most 255, the column size).
    "KEY_MAX_LENGTH": 255,
    # Seconds a key and its stored response are kept (then purged).
    "KEY_TTL": 24 * 3600,
    # Seconds a claim is held without a heartbeat; a heartbeat renews it every third.
    "KEY_LEASE": 30,
    # Live keys (and tokens) one principal may hold; more gets 429.
    "KEY_QUOTA": 1000,
    # Seconds an issued, unused token stays valid.
    "TOKEN_TTL": 3600,
    # Unused tokens one principal may hold (the endpoint answers 429 past it,
    # the template tag drops the principal's oldest unused tokens).
    "TOKEN_QUOTA": 100,
    # Largest request body an idempotent view accepts (413 above).
    "MAX_REQUEST_BYTES": 1024 * 1024,
    # Largest response body stored for replay; larger ones are stored without body.
    "MAX_STORED_RESPONSE_BYTES": 1024 * 1024,
    # Response headers stored and replayed (case-insensitive).
    "REPLAY_HEADERS": ["Content-Type", "Content-Language", "Location", "Cache-Control"],
    # Seconds a second form submit waits for the first one before answering 409.
    "FORM_WAIT": 15,
    # Retry-After (seconds) on 409 "still in flight" and 429 answers.
    "RETRY_AFTER": 1,
    # Dotted path of ``callable(request) -> str | None`` naming the request's principal.
    "PRINCIPAL_RESOLVER": "idempotent_orders.http.keys.default_principal",
    # Business-key time window (seconds) of create_order().
    "ORDER_WINDOW": 300,
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

    @property
    def KEY_MAX_LENGTH(self) -> int:
        return int(self._get("KEY_MAX_LENGTH"))

    @property
    def KEY_TTL(self) -> int:
        return int(self._get("KEY_TTL"))

    @property
    def KEY_LEASE(self) -> int:
        return int(self._get("KEY_LEASE"))

    @property
    def KEY_QUOTA(self) -> int:
        return int(self._get("KEY_QUOTA"))

    @property
    def TOKEN_TTL(self) -> int:
        return int(self._get("TOKEN_TTL"))

    @property
    def TOKEN_QUOTA(self) -> int:
        return int(self._get("TOKEN_QUOTA"))

    @property
    def MAX_REQUEST_BYTES(self) -> int:
        return int(self._get("MAX_REQUEST_BYTES"))

    @property
    def MAX_STORED_RESPONSE_BYTES(self) -> int:
        return int(self._get("MAX_STORED_RESPONSE_BYTES"))

    @property
    def REPLAY_HEADERS(self) -> list[str]:
        return [str(h) for h in self._get("REPLAY_HEADERS")]

    @property
    def FORM_WAIT(self) -> int:
        return int(self._get("FORM_WAIT"))

    @property
    def RETRY_AFTER(self) -> int:
        return int(self._get("RETRY_AFTER"))

    @property
    def PRINCIPAL_RESOLVER(self) -> str:
        return str(self._get("PRINCIPAL_RESOLVER"))

    @property
    def ORDER_WINDOW(self) -> int:
        return int(self._get("ORDER_WINDOW"))


conf = Settings()
