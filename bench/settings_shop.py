"""The benchmark settings with the demo's ShopOrder swapped in (transition bodies), on a
database of its own (``BENCH_DB_NAME`` + ``_shop``): the order model is fixed at migrate."""

import os

os.environ["IO_TEST_DB_NAME"] = os.environ.get("BENCH_DB_NAME", "bench_idempotent_orders") + "_shop"

from bench.settings import *  # noqa: F403
from bench.settings import IDEMPOTENT_ORDERS

IDEMPOTENT_ORDERS_ORDER_MODEL = "demo_project.ShopOrder"
# The demo's own configuration: the fulfilment step drives ShopOrder.start_picking.
IDEMPOTENT_ORDERS = {**IDEMPOTENT_ORDERS, "FULFILMENT_TRANSITION": "start_picking"}
