"""The no-op task the consumer is measured beside, on the same broker and queue."""

from __future__ import annotations

import redis
from celery import shared_task
from django.conf import settings

_client: redis.Redis | None = None


@shared_task(name="bench.noop", acks_late=True, reject_on_worker_lost=True)
def noop(counter: str) -> None:
    """Count itself and return: the broker's and Celery's own cost per message."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL)
    _client.incr(counter)


# Section 4 (celery-once): the same slow task under celery-once and under @idempotent.
# celery-once is a benchmark-only dependency; the app never imports it.
try:
    from celery_once import QueueOnce
except ImportError:  # pragma: no cover - the bench extra is not installed
    QueueOnce = None

if QueueOnce is not None:
    import time as _time
    import uuid as _uuid
    from decimal import Decimal as _Decimal

    from celery import current_app

    from idempotent_orders.idempotent import idempotent
    from idempotent_orders.models import Order

    current_app.conf.ONCE = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": settings.REDIS_URL, "default_timeout": 600},
    }

    def _client_() -> redis.Redis:
        global _client
        if _client is None:
            _client = redis.Redis.from_url(settings.REDIS_URL)
        return _client

    @shared_task(
        base=QueueOnce,
        name="bench.once_effect",
        once={"graceful": True, "keys": ["key"]},
        acks_late=True,
        reject_on_worker_lost=True,
    )
    def once_effect(counter: str, key: str, delay: float) -> None:
        """The effect (one count per run), then slow work a kill can interrupt."""
        _client_().incr(f"{counter}:effect:{key}")
        _client_().incr(f"{counter}:started")
        _time.sleep(delay)
        _client_().incr(f"{counter}:finished")

    @shared_task(name="bench.idempotent_effect", acks_late=True, reject_on_worker_lost=True)
    @idempotent(key="key", consumer="bench.idempotent_effect")
    def idempotent_effect(counter: str, key: str, delay: float) -> None:
        """The effect (an order row, committed with the inbox row), then the same slow work."""
        Order.objects.create(
            business_key=f"{counter}:{key}:{_uuid.uuid4().hex}",
            amount=_Decimal("1"),
            currency="CNY",
        )
        _client_().incr(f"{counter}:started")
        _time.sleep(delay)
        _client_().incr(f"{counter}:finished")
