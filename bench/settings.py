"""Settings of the benchmarks: the test settings on PostgreSQL, plus the bench tasks."""

import os

os.environ.setdefault("IO_TEST_DATABASE", "postgres")
os.environ.setdefault("IO_TEST_DB_NAME", os.environ.get("BENCH_DB_NAME", "bench_idempotent_orders"))
os.environ["IO_WORKER_DB"] = "1"  # open the named database itself, no test_ prefix

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "bench"]
CELERY_TASK_IGNORE_RESULT = True
