"""Settings of the benchmarks: the test settings on PostgreSQL, plus the bench tasks."""

import os

os.environ.setdefault("IO_TEST_DATABASE", "postgres")
os.environ.setdefault("IO_TEST_DB_NAME", os.environ.get("BENCH_DB_NAME", "bench_idempotent_orders"))
# Redis database 0, not the tests' (whose per-test cleanup would walk the bench's keys).
os.environ.setdefault("IO_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
os.environ["IO_WORKER_DB"] = "1"  # open the named database itself, no test_ prefix

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "bench"]
CELERY_TASK_IGNORE_RESULT = True

# Section 3/4 (HTTP): the bench urlconf (the app's API plus the undecorated and peer
# variants of the same view), the peers' settings, and a key quota that a run of
# thousands of requests by one user does not reach. The peers are benchmark-only.
ROOT_URLCONF = "bench.urls"
INSTALLED_APPS = [*INSTALLED_APPS, "drf_idempotency"]
IDEMPOTENT_ORDERS = {**IDEMPOTENT_ORDERS, "KEY_QUOTA": 10_000_000, "TOKEN_QUOTA": 10_000_000}  # noqa: F405
# django-idempotency-key as its README recommends for several processes: responses in
# the (Redis) cache, the check guarded by a Redis lock.
IDEMPOTENCY_KEY = {
    "STORAGE": {"CLASS": "idempotency_key.storage.CacheKeyStorage", "CACHE_NAME": "default"},
    "LOCK": {
        "CLASS": "idempotency_key.locks.redis.MultiProcessRedisLock",
        "LOCATION": REDIS_URL,  # noqa: F405
        "NAME": f"bench-idempotency-key-{TEST_DB_NAME}",  # noqa: F405
        "TIMEOUT": 5,
    },
    # A replay answers with the stored status (its default answers a replay 409),
    # as @idempotent and drf-idempotency do.
    "CONFLICT_STATUS_CODE": None,
}
# drf-idempotency's default: the database backend (its own table).
IDEMPOTENCY = {"BACKEND": "drf_idempotency.backends.database.DatabaseBackend"}

# The real-server HTTP bench (gunicorn, bench/http_server.py). By default the demo's
# middleware stack, the caller logged in by its session cookie (database sessions, as
# the demo has them); BENCH_HTTP_AUTH=header names the caller by a header instead (no
# session queries: the NON-DEFAULT row). django-idempotency-key's middleware is
# installed for every variant alike (it only acts on the views its decorator marks).
if os.environ.get("BENCH_HTTP_SERVER") == "1":
    if os.environ.get("BENCH_HTTP_AUTH", "session") == "header":
        MIDDLEWARE = ["bench.http_server.HeaderUserMiddleware"]
    else:
        from demo_project.settings import MIDDLEWARE
    MIDDLEWARE = [*MIDDLEWARE, "idempotency_key.middleware.ExemptIdempotencyKeyMiddleware"]

# Section 7 (outbox): django-celery-outbox, benchmark-only, driven through its own
# OutboxCelery app; its StatsD metrics are off (nothing listens for them here).
try:
    import django_celery_outbox  # noqa: F401
except ImportError:
    pass
else:
    INSTALLED_APPS = [*INSTALLED_APPS, "django_celery_outbox"]
    CELERY_OUTBOX_APP = "bench.outbox_peer.peer_app"
    MONITORING_METRICS_ENABLED = False
