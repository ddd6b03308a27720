"""django-celery-outbox's Celery app for the outbox section (benchmark-only, never the app's).

Its ``send_task`` writes a ``CeleryOutbox`` row in the caller's transaction;
its relay publishes through this app.
"""

from __future__ import annotations

from django_celery_outbox import OutboxCelery

# Not the current app: the demo app stays the one our outbox and tasks publish through.
peer_app = OutboxCelery("bench_outbox_peer", set_as_current=False)
peer_app.config_from_object("django.conf:settings", namespace="CELERY")
