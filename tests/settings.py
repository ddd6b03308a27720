"""Settings for the test suite, apart from the demo project.

``IO_TEST_DATABASE`` picks the database: ``sqlite`` (default), ``postgres`` or
``mariadb``. Service addresses come from ``IO_TEST_POSTGRES_URL``,
``IO_TEST_MARIADB_URL``, ``IO_TEST_REDIS_URL`` and ``IO_TEST_RABBITMQ_URL``.
A worker subprocess sets ``IO_WORKER_DB=1`` to open the test database itself.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from typing import Any

from demo_project.databases import database_from_url, sqlite_database

SECRET_KEY = "tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
# The demo's one time format (the admin's dates as its timeline's), as the demo sets it.
FORMAT_MODULE_PATH = ["demo_project.formats"]

BACKEND = os.environ.get("IO_TEST_DATABASE", "sqlite")
#: Name of the database the tests run in; parallel runs pick different names.
TEST_DB_NAME = os.environ.get("IO_TEST_DB_NAME", "test_idempotent_orders")
WORKER = os.environ.get("IO_WORKER_DB") == "1"

POSTGRES_URL = os.environ.get("IO_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")
MARIADB_URL = os.environ.get("IO_TEST_MARIADB_URL", "mysql://root@127.0.0.1:3306/test")
# The tests' own logical database: each test's cleanup walks the database it runs in, so
# it must not share one with an application's or a benchmark's keys (database 0). Database 1
# is the worker tests' Redis broker (tests/support/services.py); tests/support/matrix.py gives
# each leg running a database of its own from 3 to 14.
REDIS_URL = os.environ.get("IO_TEST_REDIS_URL", "redis://127.0.0.1:6379/2")
RABBITMQ_URL = os.environ.get("IO_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _database() -> dict[str, Any]:
    if BACKEND == "sqlite":
        path = os.path.join(tempfile.gettempdir(), f"{TEST_DB_NAME}.sqlite3")
        db = sqlite_database(path)
        db["TEST"] = {"NAME": path}
        if WORKER:
            db["NAME"] = path
        return db
    if BACKEND == "postgres":
        db = database_from_url(POSTGRES_URL)
    elif BACKEND == "mariadb":
        db = database_from_url(MARIADB_URL)
        # Case- and pad-sensitive comparisons, as message ids need (see README).
        db["TEST"] = {"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_nopad_bin"}
    else:
        raise ValueError(f"IO_TEST_DATABASE must be sqlite, postgres or mariadb, not {BACKEND!r}")
    db["CONN_MAX_AGE"] = 0
    db.setdefault("TEST", {})["NAME"] = TEST_DB_NAME
    if WORKER:
        db["NAME"] = TEST_DB_NAME
        db["CONN_MAX_AGE"] = 60
    return db


DATABASES = {"default": _database()}

CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": os.environ.get("IO_TEST_NAMESPACE", TEST_DB_NAME),
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 0.5},
    }
}

# A private Redis for the dedup layer (tests that flush or kill it start their own).
if os.environ.get("IO_TEST_DEDUP_REDIS_URL"):
    CACHES["dedup"] = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": os.environ["IO_TEST_DEDUP_REDIS_URL"],
        "KEY_PREFIX": os.environ.get("IO_TEST_NAMESPACE", TEST_DB_NAME),
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 0.5},
    }

CELERY_BROKER_URL = os.environ.get("IO_TEST_BROKER_URL", "memory://")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("IO_TEST_QUEUE", f"{TEST_DB_NAME}-tasks")
CELERY_TASK_ACKS_LATE = True
# Test-only tasks the workers must know (the trace and dead-letter tests).
CELERY_IMPORTS = ("tests.support.trace_tasks", "tests.support.dead_tasks", "tests.support.poison")
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Keep database connections across tasks (idempotent_orders recycles broken ones).
CELERY_DB_REUSE_MAX = 1000
CELERY_RESULT_BACKEND = os.environ.get("IO_TEST_RESULT_BACKEND", "cache+memory://")
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "idempotent_orders",
    "demo_project",
]
# Django's task framework: the immediate backend by default, and a database
# backend whose `db_worker` runs as a real process in tests/http/test_contrib_tasks.py.
try:
    import django_tasks_db  # noqa: F401
except ImportError:
    TASKS_DB_BACKEND = False
else:
    TASKS_DB_BACKEND = True
    INSTALLED_APPS.append("django_tasks_db")
TASKS = {
    "default": {
        "BACKEND": "django.tasks.backends.immediate.ImmediateBackend"
        if importlib.util.find_spec("django.tasks")
        else "django_tasks.backends.immediate.ImmediateBackend"
    },
    **({"db": {"BACKEND": "django_tasks_db.DatabaseBackend"}} if TASKS_DB_BACKEND else {}),
}
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "idempotent_orders.http.middleware.ProblemMiddleware",
]
ROOT_URLCONF = "demo_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# Unit tests run the consumer synchronously; worker tests turn fulfilment on.
IDEMPOTENT_ORDERS: dict[str, Any] = {
    "FULFIL_AFTER_PAYMENT": os.environ.get("IO_TEST_FULFIL") == "1",
    # Fast-path keys left in the shared Redis by a test run expire soon.
    "DEDUP_WINDOW": 600,
    "DEDUP_REDIS_TTL_MARGIN": 60,
    # The machine running the suite is loaded: a slow answer is not an outage here
    # (the frozen-Redis test sets the default bound itself).
    "DEDUP_REDIS_TIMEOUT": 0.5,
    "FULFILMENT_CLIENT": "demo_project.warehouse.FakeWarehouse",
    # The test client's address (the access-control tests override it).
    "METRICS_ALLOW_IPS": ["127.0.0.1"],
    # A test reads at once what it just wrote: the first lookup loads the window before
    # answering (tests/dedup/test_dedup.py tests the background load on its own).
    "DEDUP_BLOOM_WARM_UP_IN_BACKGROUND": False,
}
if "dedup" in CACHES:
    IDEMPOTENT_ORDERS["DEDUP_CACHE_ALIAS"] = "dedup"
# The whole suite against an inbox partitioned by day (PostgreSQL): tests/conftest.py
# converts the test database's inbox once it is created.
if os.environ.get("IO_TEST_PARTITIONED_INBOX") == "1":
    IDEMPOTENT_ORDERS["INBOX_PARTITION_DAYS"] = 1
# Worker tests shorten leases so a killed worker's row expires within the test.
if os.environ.get("IO_TEST_LEASE_SECONDS"):
    IDEMPOTENT_ORDERS["LEASE_SECONDS"] = int(os.environ["IO_TEST_LEASE_SECONDS"])
    IDEMPOTENT_ORDERS["HEARTBEAT_SECONDS"] = 1


# The quorum-queue worker test: the default queue is a quorum queue on a topic exchange,
# which Celery's native delayed delivery needs for the retries' countdown (docs/operations.md).
if os.environ.get("IO_TEST_QUORUM") == "1":
    CELERY_TASK_DEFAULT_QUEUE_TYPE = "quorum"
    CELERY_TASK_DEFAULT_EXCHANGE_TYPE = "topic"
    CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}


# The failure-path worker test retries a failed message quickly, a few times.
if os.environ.get("IO_TEST_TASK_MAX_RETRIES"):
    IDEMPOTENT_ORDERS["TASK_MAX_RETRIES"] = int(os.environ["IO_TEST_TASK_MAX_RETRIES"])
    IDEMPOTENT_ORDERS["TASK_RETRY_BACKOFF_MAX"] = 1


# The live server's static-files handler needs a STATIC_URL (HTTP live tests).
STATIC_URL = "static/"


# The original django-fsm leg (`make test`, tests/support/matrix.py) runs the app on the
# archived django-fsm 2.8.x, as a shop that stays on it does: with W004 silenced.
DJANGO_FSM = os.environ.get("IO_TEST_DJANGO_FSM", "django-fsm-2")
SILENCED_SYSTEM_CHECKS = [] if DJANGO_FSM == "django-fsm-2" else ["idempotent_orders.W004"]

# Django 6.1's mailers (the testing kit's tests send e-mail): Django's test outbox.
# Django 5.2 ignores the setting.
MAILERS = {"default": {"BACKEND": "django.core.mail.backends.locmem.EmailBackend"}}
