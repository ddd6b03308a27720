"""Settings of the demo project.

With no environment variables it runs on an embedded default that needs no
server: SQLite in ``.demo/`` and Celery on kombu's filesystem transport.
``DATABASE_URL``, ``REDIS_URL`` and ``CELERY_BROKER_URL`` switch to real services.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from demo_project.databases import database_from_url, sqlite_database
from idempotent_orders.beat import beat_schedule

BASE_DIR = Path(__file__).resolve().parent.parent
STATE_DIR = Path(os.environ.get("DEMO_STATE_DIR", BASE_DIR / ".demo"))
STATE_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "demo-only-insecure-key")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]", "testserver"]


DATABASES = {
    "default": (
        database_from_url(os.environ["DATABASE_URL"])
        if os.environ.get("DATABASE_URL")
        else sqlite_database(STATE_DIR / "demo.sqlite3")
    )
}

REDIS_URL = os.environ.get("REDIS_URL", "")
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": REDIS_URL,
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 1},
        }
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "filesystem://")
if CELERY_BROKER_URL.startswith("filesystem://"):
    # kombu's filesystem transport with atomic message files (demo_project/broker.py).
    CELERY_BROKER_TRANSPORT = "demo_project.broker:Transport"
    _broker_dir = STATE_DIR / "broker"
    for _sub in ("queue", "processed", "control"):
        (_broker_dir / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "processed_folder": str(_broker_dir / "processed"),
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
        # The transport polls a folder; the default 1 s interval caps a worker at ~1 msg/s.
        "polling_interval": 0.01,
    }
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("DEMO_CELERY_QUEUE", "idempotent-orders-demo")
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Keep database connections across tasks (idempotent_orders recycles broken ones).
CELERY_DB_REUSE_MAX = 1000
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "idempotent_orders",
    "demo_project",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "idempotent_orders.http.middleware.ProblemMiddleware",
]

ROOT_URLCONF = "demo_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "demo_project" / "templates"],
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
WSGI_APPLICATION = "demo_project.wsgi.application"
STATIC_URL = "static/"
USE_TZ = True
TIME_ZONE = "UTC"
# One time format on the admin's and the shop's pages: "2026-11-28 18:49:13".
FORMAT_MODULE_PATH = ["demo_project.formats"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# The shop's own order model (state field `state`, its own states and a `pack`
# step), swapped in like AUTH_USER_MODEL; set before the first migrate.
IDEMPOTENT_ORDERS_ORDER_MODEL = "demo_project.ShopOrder"

IDEMPOTENT_ORDERS: dict[str, Any] = {
    # The fulfilment step drives ShopOrder.start_picking (paid -> picking).
    "FULFILMENT_TRANSITION": "start_picking",
    # The fake warehouse can be told to fail, hang or lose its reply (demo_project/warehouse.py).
    "FULFILMENT_CLIENT": "demo_project.warehouse.FakeWarehouse",
    # Without REDIS_URL the embedded default has no django-redis cache: Bloom filter only.
    # The Redis layer needs django-redis; the embedded default has none.
    "DEDUP_CACHE_ALIAS": "default" if REDIS_URL else "",
    # FakePay (demo_project/payments.py) posts Stripe-style signed webhooks to /webhooks/fakepay/.
    "WEBHOOKS": {
        "fakepay": {
            "SCHEME": "stripe",
            "SECRET": os.environ.get("DEMO_FAKEPAY_SECRET", "whsec_demo_only_not_secret"),
            "EVENT_TYPES": {"payment_intent.succeeded": "payment.succeeded"},
            "TO_MESSAGE": "idempotent_orders.webhooks.stripe.payment_intent",
        }
    },
    # Unpaid orders expire (a durable timer fired by beat's fire_due_timers).
    "PAYMENT_TIMEOUT": int(os.environ.get("DEMO_PAYMENT_TIMEOUT", 15 * 60)),
}

# The periodic tasks run on Celery beat (`celery -A demo_project beat`): every one the app
# has, at the recommended intervals (idempotent_orders/beat.py says what each is for).
CELERY_BEAT_SCHEDULE = beat_schedule()

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # One JSON object a line, carrying message_id and order_id where known.
    "formatters": {"json": {"()": "idempotent_orders.observability.JsonFormatter"}},
    # ... and the trace context (traceparent, correlation_id) a message carried.
    "filters": {"trace": {"()": "idempotent_orders.tracing.TraceLogFilter"}},
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "json", "filters": ["trace"]}
    },
    "loggers": {"idempotent_orders": {"handlers": ["console"], "level": "INFO"}},
}
