"""Settings of chaos-test workers: the test settings plus fulfilment and a short redelivery time."""

from __future__ import annotations

import os

from tests.settings import *  # noqa: F403
from tests.settings import IDEMPOTENT_ORDERS

# The chaos stream checks that fulfilment, a follow-up task, also happens at most once.
# Short leases: a fulfilment step whose worker is SIGKILLed mid-call expires
# quickly and the test's reconciler passes resolve it.
IDEMPOTENT_ORDERS = {
    **IDEMPOTENT_ORDERS,
    "FULFIL_AFTER_PAYMENT": True,
    "LEASE_SECONDS": 5,
    "HEARTBEAT_SECONDS": 1,
}

# On the Redis broker a SIGKILLed worker's unacknowledged message comes back only
# after the visibility timeout (an hour by default): shorten it for the test.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": int(os.environ.get("IO_CHAOS_VISIBILITY_TIMEOUT", "10"))
}
