"""The idempotency keys admin: stored HTTP responses, read by operators, never edited."""

from __future__ import annotations

from django.contrib import admin

from idempotent_orders.admin.common import ReadOnlyEvidenceAdmin
from idempotent_orders.models import (
    IdempotencyKey,
)


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(ReadOnlyEvidenceAdmin):
    list_display = [
        "key",
        "principal",
        "method",
        "route",
        "state",
        "response_status",
        "lease_expires_at",
        "expires_at",
    ]
    list_filter = ["state", "is_token", "method"]
    search_fields = ["key", "principal", "route"]
    # Stored responses are evidence: operators read them, never edit them.
    readonly_fields = [f.name for f in IdempotencyKey._meta.fields]
