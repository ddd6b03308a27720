"""The test settings with the project's own order model swapped in (``shop.Order``)."""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import IDEMPOTENT_ORDERS, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.shop"]
IDEMPOTENT_ORDERS_ORDER_MODEL = "shop.Order"
IDEMPOTENT_ORDERS = {**IDEMPOTENT_ORDERS, "FULFILMENT_TRANSITION": "pick"}
