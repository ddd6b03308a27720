"""The test settings with an order model that has what shops run on ``save()``:
an override, a ``post_save`` receiver, django-simple-history and django-auditlog
(``history.Order``, tests/history)."""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "simple_history", "auditlog", "tests.history"]
IDEMPOTENT_ORDERS_ORDER_MODEL = "history.Order"
