"""Demo shop for idempotent_orders; the Celery app is loaded with Django."""

from demo_project.celery import app as celery_app

__all__ = ["celery_app"]
