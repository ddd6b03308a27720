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
    # Leased work with an effect outside the database (see leases.py).
    # A claim is valid this long (seconds) unless a heartbeat extends it.
    "LEASE_SECONDS": 30,
    # How often a running step extends its lease; well under LEASE_SECONDS.
    "HEARTBEAT_SECONDS": 10,
    # The fulfilment step's warehouse client and the reconciler's verifier (dotted paths).
    "FULFILMENT_CLIENT": "idempotent_orders.fulfilment.NullWarehouse",
    "FULFILMENT_VERIFIER": "idempotent_orders.fulfilment.ClientVerifier",
    # Expired leases a row may have (stalls) before the reconciler marks it failed.
    "RECONCILE_MAX_STALLS": 3,
    # Rows the reconciler handles per run.
    "RECONCILE_BATCH_SIZE": 100,
    # Parked messages older than this (seconds) are given up: their inbox row is
    # marked rejected with a reason, so they are kept and explained, not lost.
    "PARKED_RETENTION": 30 * 24 * 3600,
    # Rows deleted per statement by the retention purge.
    "PURGE_BATCH_SIZE": 1000,
    # Longest time (seconds) the broker may hold an unacknowledged message before
    # redelivering it, when the check cannot read it from the transport options
    # (RabbitMQ's consumer_timeout, for example). 0 means unknown.
    "BROKER_REDELIVERY_HORIZON": 0,
    # Fast-path dedup layers in front of the inbox ("bloom", "redis").
    "DEDUP_LAYERS": ["bloom", "redis"],
    # Cache alias used by the Redis layer and locks; must be a django-redis cache.
    "CACHE_ALIAS": "default",
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
    def LEASE_SECONDS(self) -> float:
        return float(self._get("LEASE_SECONDS"))

    @property
    def HEARTBEAT_SECONDS(self) -> float:
        return float(self._get("HEARTBEAT_SECONDS"))

    @property
    def FULFILMENT_CLIENT(self) -> str:
        return str(self._get("FULFILMENT_CLIENT"))

    @property
    def FULFILMENT_VERIFIER(self) -> str:
        return str(self._get("FULFILMENT_VERIFIER"))

    @property
    def RECONCILE_MAX_STALLS(self) -> int:
        return int(self._get("RECONCILE_MAX_STALLS"))

    @property
    def RECONCILE_BATCH_SIZE(self) -> int:
        return int(self._get("RECONCILE_BATCH_SIZE"))

    @property
    def PARKED_RETENTION(self) -> int:
        return int(self._get("PARKED_RETENTION"))

    @property
    def PURGE_BATCH_SIZE(self) -> int:
        return int(self._get("PURGE_BATCH_SIZE"))

    @property
    def BROKER_REDELIVERY_HORIZON(self) -> int:
        return int(self._get("BROKER_REDELIVERY_HORIZON"))

    @property
    def DEDUP_LAYERS(self) -> list[str]:
        return list(self._get("DEDUP_LAYERS"))

    @property
    def CACHE_ALIAS(self) -> str:
        return str(self._get("CACHE_ALIAS"))


conf = Settings()
