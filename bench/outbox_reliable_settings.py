"""Settings of the outbox section's second peer, django-reliable-outbox (benchmark-only).

Used by ``bench.outbox_reliable`` in its own venv (Python >= 3.12, see
``make/bench.mk``): the test settings on the benchmark's PostgreSQL database,
plus ``reliable_outbox``. Its events go to one destination,
:class:`bench.outbox_reliable.CeleryTaskDestination`, which publishes each one
as the Celery task of its name to the section's queue (``BENCH_PEER_QUEUE``),
on the section's broker: the messages our relay publishes, on the same broker.
"""

import os

os.environ.setdefault("IO_TEST_DATABASE", "postgres")
os.environ.setdefault("IO_TEST_DB_NAME", os.environ.get("BENCH_DB_NAME", "bench_idempotent_orders"))
os.environ["IO_WORKER_DB"] = "1"  # open the named database itself, no test_ prefix

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "reliable_outbox"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_URL = os.environ.get("BENCH_PEER_BROKER_URL", "memory://")
RELIABLE_OUTBOX = {
    "DESTINATIONS": {
        "default": {
            "BACKEND": "bench.outbox_reliable.CeleryTaskDestination",
            "OPTIONS": {"queue": os.environ.get("BENCH_PEER_QUEUE", "bench-outbox")},
        }
    },
    # Its handler and job modules: none here.
    "AUTODISCOVER": (),
}
