"""``manage.py purge_idempotency_keys``: delete expired idempotency keys and tokens."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from idempotent_orders.http.keys import purge_expired


class Command(BaseCommand):
    help = "Delete idempotency keys and one-time tokens past their expiry (KEY_TTL / TOKEN_TTL)."

    def handle(self, *args: Any, **options: Any) -> None:
        deleted = purge_expired()
        self.stdout.write(f"purged {deleted} expired idempotency keys")
