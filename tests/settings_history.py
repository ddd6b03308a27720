"""The test settings with an order model that has what shops run on ``save()``:
an override, a ``post_save`` receiver, django-simple-history, django-auditlog,
django-reversion and django-pghistory (``history.Order``, tests/history)."""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [
    *INSTALLED_APPS,
    "simple_history",
    "auditlog",
    "reversion",
    # django-pghistory's triggers are installed on PostgreSQL only (pgtrigger's migrations).
    "pgtrigger",
    "pghistory",
    "tests.history",
]
IDEMPOTENT_ORDERS_ORDER_MODEL = "history.Order"
