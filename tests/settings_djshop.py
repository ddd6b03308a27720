"""The test settings with django-SHOP's order workflow as the order model
(``djshop.Order``, tests/djshop)."""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import IDEMPOTENT_ORDERS, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.djshop"]
IDEMPOTENT_ORDERS_ORDER_MODEL = "djshop.Order"
IDEMPOTENT_ORDERS = {**IDEMPOTENT_ORDERS, "FULFILMENT_TRANSITION": ""}
