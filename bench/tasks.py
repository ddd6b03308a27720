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
