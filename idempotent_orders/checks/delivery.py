"""Checks that a message is applied once however it arrives: caches, broker, Celery, database.

The lock cache and the Redis dedup layer (E080, E010, E012, E033), inbox rows
that outlive every redelivery of the broker, Celery's retries and each webhook
provider's retries (E030, E051), the app's tasks acknowledged late (E031, E032,
W031), webhook providers well formed (E050) with their events kept through their
retries (W051), MySQL/MariaDB at READ COMMITTED (E034), and the app's tables on a
database it knows (W032).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured

from idempotent_orders.checks.configuration import well_typed
from idempotent_orders.conf import DEFAULTS

__all__ = [
    "DEFAULT_VISIBILITY_TIMEOUT",
    "TASK_NAMES",
    "VISIBILITY_TRANSPORTS",
    "check_celery_tasks",
    "check_database_vendor",
    "check_dedup",
    "check_isolation",
    "check_outbox_and_locks",
    "check_redis_layer",
    "check_retention",
    "check_webhooks",
    "isolation_errors",
    "redelivery_horizon",
]

#: The app's tasks; each must acknowledge late and be rejected when its worker dies.
TASK_NAMES = (
    "idempotent_orders.consume_payment",
    "idempotent_orders.consume_shipping",
    "idempotent_orders.fulfil_order",
)
#: Transports whose unacknowledged messages come back after ``visibility_timeout``,
#: with kombu's default of one hour.
VISIBILITY_TRANSPORTS = ("redis", "rediss", "sqs", "sentinel")
DEFAULT_VISIBILITY_TIMEOUT = 3600


@register(Tags.compatibility, Tags.caches)
def check_outbox_and_locks(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The lock cache exists (outbox sizes and times: E036)."""
    user = getattr(settings, "IDEMPOTENT_ORDERS", {})
    if not isinstance(user, dict):
        return []  # E001 already reports it
    errors: list[CheckMessage] = []
    alias = user.get("LOCK_CACHE", DEFAULTS["LOCK_CACHE"])
    if isinstance(alias, str) and alias not in getattr(settings, "CACHES", {}):
        errors.append(
            Error(
                f"IDEMPOTENT_ORDERS['LOCK_CACHE'] is {alias!r}, which is not in settings.CACHES.",
                hint="Point it at a django-redis cache alias.",
                id="idempotent_orders.E080",
            )
        )
    return errors


@register(Tags.compatibility, Tags.caches)
def check_dedup(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The fast-path layers need a cache that exists and a sane Bloom error rate."""
    from idempotent_orders.conf import conf

    user = getattr(settings, "IDEMPOTENT_ORDERS", {})
    if not isinstance(user, dict):
        return []  # E001 already
    try:
        alias = conf.DEDUP_CACHE_ALIAS
        error_rate = conf.DEDUP_BLOOM_ERROR_RATE
    except (TypeError, ValueError):
        return []  # E003 already
    errors: list[CheckMessage] = []
    caches = getattr(settings, "CACHES", {})
    if alias and alias not in caches:
        errors.append(
            Error(
                f"IDEMPOTENT_ORDERS['DEDUP_CACHE_ALIAS'] is {alias!r}, which is not in CACHES.",
                hint='Name a django-redis cache, or set it to "" to switch the Redis layer off.',
                id="idempotent_orders.E010",
            )
        )
    if not 0 < error_rate < 1:
        errors.append(
            Error(
                "IDEMPOTENT_ORDERS['DEDUP_BLOOM_ERROR_RATE'] must be between 0 and 1 "
                f"(exclusive), got {error_rate}.",
                id="idempotent_orders.E012",
            )
        )
    return errors


def _celery_setting(name: str, default: Any = None) -> Any:
    """A Celery setting as a Django project gives it (``CELERY_<NAME>``)."""
    return getattr(settings, f"CELERY_{name.upper()}", default)


def redelivery_horizon() -> int:
    """Longest time (seconds) after which the broker or Celery may deliver a message again."""
    from idempotent_orders.conf import conf

    horizons = [conf.BROKER_REDELIVERY_HORIZON]
    broker = str(_celery_setting("broker_url", "") or "")
    scheme = broker.split("://", 1)[0].split("+", 1)[0].lower()
    options = _celery_setting("broker_transport_options", {}) or {}
    if scheme in VISIBILITY_TRANSPORTS:
        horizons.append(int(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT)))
    # The retry budget for transient errors: every backoff of every retry.
    budget = sum(
        min(conf.TASK_RETRY_BACKOFF_MAX, 2**attempt) for attempt in range(conf.TASK_MAX_RETRIES)
    )
    horizons.append(budget)
    return max(horizons)


@register(Tags.compatibility)
def check_retention(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Dedup rows must outlive every redelivery, or a late copy is applied again."""
    from idempotent_orders.conf import conf

    names = ("DEDUP_RETENTION", "BROKER_REDELIVERY_HORIZON", "TASK_MAX_RETRIES")
    if not all(well_typed(n) for n in (*names, "TASK_RETRY_BACKOFF_MAX")):
        return []
    horizon = redelivery_horizon()
    if horizon >= conf.DEDUP_RETENTION:
        return [
            Error(
                f"DEDUP_RETENTION ({conf.DEDUP_RETENTION}s) is not longer than the longest "
                f"redelivery horizon ({horizon}s: broker visibility/consumer timeout and the "
                "task retry budget). A message redelivered after its inbox row is purged "
                "would be applied again.",
                hint="Raise IDEMPOTENT_ORDERS['DEDUP_RETENTION'] well above it.",
                id="idempotent_orders.E030",
            )
        ]
    return []


@register(Tags.compatibility)
def check_celery_tasks(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The app's tasks must ack late and be rejected (redelivered) when their worker dies."""
    from celery import current_app

    from idempotent_orders import tasks  # noqa: F401  (registers them)

    errors: list[CheckMessage] = []
    registry = current_app.tasks
    for name in TASK_NAMES:
        task = registry.get(name)
        if task is None:
            continue
        if not task.acks_late:
            errors.append(
                Error(
                    f"Celery task {name} runs without acks_late: a worker that dies "
                    "mid-message loses it.",
                    hint="Do not override acks_late for the app's tasks "
                    "(task_annotations, CELERY_TASK_ACKS_LATE=False with a custom task).",
                    id="idempotent_orders.E031",
                )
            )
        if not task.reject_on_worker_lost:
            errors.append(
                Error(
                    f"Celery task {name} runs without reject_on_worker_lost: a killed "
                    "worker's message is acknowledged instead of redelivered.",
                    id="idempotent_orders.E032",
                )
            )
    prefetch = _celery_setting("worker_prefetch_multiplier", None)
    if isinstance(prefetch, int) and prefetch != 1:
        errors.append(
            Warning(
                f"CELERY_WORKER_PREFETCH_MULTIPLIER is {prefetch}: with acks_late a busy "
                "worker holds messages others could run, and a crash redelivers all of them.",
                hint="Set CELERY_WORKER_PREFETCH_MULTIPLIER = 1.",
                id="idempotent_orders.W031",
            )
        )
    return errors


@register(Tags.caches)
def check_redis_layer(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The Redis dedup layer and the locks need a django-redis cache."""
    from idempotent_orders.conf import conf

    if not well_typed("DEDUP_CACHE_ALIAS"):
        return []
    alias = conf.DEDUP_CACHE_ALIAS
    caches = getattr(settings, "CACHES", {})
    if not alias or alias not in caches:
        return []  # off, or E010 reports the missing alias
    backend = str(caches[alias].get("BACKEND", ""))
    if not backend.startswith("django_redis."):
        return [
            Error(
                f"The Redis dedup layer is enabled but cache {alias!r} is {backend}, "
                "not a django-redis cache.",
                hint="Configure django_redis.cache.RedisCache, or set "
                "IDEMPOTENT_ORDERS['DEDUP_CACHE_ALIAS'] to \"\" to switch the Redis layer off.",
                id="idempotent_orders.E033",
            )
        ]
    return []


@register(Tags.compatibility)
def check_database_vendor(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The databases the app writes to are ones it knows (PostgreSQL, MariaDB/MySQL,
    SQLite): on any other it runs on portable SQL it was never run against."""
    from django.db import connections, router

    from idempotent_orders import get_order_model
    from idempotent_orders.models import IdempotencyKey, OutboxMessage, ProcessedMessage
    from idempotent_orders.vendors import vendor

    try:
        order_model = get_order_model()
    except Exception:  # the order model's own checks say why (E040-E045)
        order_model = None
    models = [ProcessedMessage, OutboxMessage, IdempotencyKey, order_model]
    aliases = sorted({router.db_for_write(m) for m in models if m is not None})
    warnings: list[CheckMessage] = []
    for alias in aliases:
        conn = connections[alias]
        if vendor(conn).name:
            continue
        engine = conn.settings_dict.get("ENGINE")
        warnings.append(
            Warning(
                f"Database {alias!r} ({engine}) is one"
                " idempotent_orders does not know:"
                " it would run there on portable SQL (INSERT ... ON CONFLICT DO NOTHING,"
                " RETURNING, COUNT-then-INSERT key quotas) tested on PostgreSQL, MariaDB"
                " and SQLite only.",
                hint="Keep the app's tables and the order model on PostgreSQL, MariaDB or"
                " SQLite (a database router may put them there), or check that this"
                " database takes that SQL before relying on it.",
                id="idempotent_orders.W032",
            )
        )
    return warnings


@register(Tags.database)
def check_isolation(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Every database reads what others committed since its transaction's first read: a
    re-read after a lost race must see the winner.

    Under REPEATABLE READ (MySQL's and MariaDB's default) the re-read inside a retried
    decision returns the old snapshot, so a consumer that lost an optimistic race loops
    on conflicts instead of seeing the winner's state.
    """
    from django.db import connections

    return isolation_errors(connections)


def isolation_errors(conns: Any) -> list[CheckMessage]:
    """E034 for each connection of ``conns`` (aliases to connections) its vendor finds
    misconfigured; W034 for one whose backend cannot be loaded."""
    from idempotent_orders.vendors import vendor

    errors: list[CheckMessage] = []
    for alias in conns:
        try:
            conn = conns[alias]
        except (ImproperlyConfigured, ImportError) as exc:
            errors.append(
                Warning(
                    f"Database {alias!r} cannot be loaded ({exc}): its isolation level"
                    " was not checked.",
                    hint="Install its driver, or remove the alias from DATABASES.",
                    id="idempotent_orders.W034",
                )
            )
            continue
        problem = vendor(conn).isolation_problem(conn.settings_dict)
        if problem:
            errors.append(
                Error(
                    f"Database {alias!r} would not see a lost race's winner when it reads"
                    f" the order again: {problem}.",
                    hint="Set DATABASES[...]['OPTIONS']['isolation_level'] = 'read committed'.",
                    id="idempotent_orders.E034",
                )
            )
    return errors


@register(Tags.compatibility)
def check_webhooks(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Webhook providers are well formed, and the inbox outlives each provider's retries."""
    from idempotent_orders.conf import conf
    from idempotent_orders.consuming import registry
    from idempotent_orders.webhooks.config import problems, provider

    if not well_typed("WEBHOOKS"):
        return []
    errors: list[CheckMessage] = []
    for name, raw in conf.WEBHOOKS.items():
        found = problems(name, raw)
        p = None if found else provider(name)
        if p is not None:
            found += [
                f"provider {name!r}: event type {event_type!r} maps to message type "
                f"{message_type!r}, which no handler registers"
                for event_type, message_type in p.event_types.items()
                if registry.get_handler(message_type) is None
            ]
        for problem in found:
            errors.append(
                Error(
                    f"settings.IDEMPOTENT_ORDERS['WEBHOOKS']: {problem}.",
                    id="idempotent_orders.E050",
                )
            )
        if (
            p is not None
            and well_typed("DEDUP_RETENTION")
            and p.retry_horizon >= conf.DEDUP_RETENTION
        ):
            errors.append(
                Error(
                    f"DEDUP_RETENTION ({conf.DEDUP_RETENTION}s) does not cover the retry "
                    f"horizon of webhook provider {name!r} ({p.retry_horizon}s): an event "
                    "retried after its inbox row is purged would be applied again.",
                    hint="Raise IDEMPOTENT_ORDERS['DEDUP_RETENTION'] well above it.",
                    id="idempotent_orders.E051",
                )
            )
        if (
            p is not None
            and well_typed("WEBHOOK_RETENTION")
            and p.retry_horizon >= conf.WEBHOOK_RETENTION
        ):
            errors.append(
                Warning(
                    f"WEBHOOK_RETENTION ({conf.WEBHOOK_RETENTION}s) does not cover the retry "
                    f"horizon of webhook provider {name!r} ({p.retry_horizon}s): an event id "
                    "the provider reuses for another event after the first event's row is "
                    "purged is no longer flagged, but taken for a retry.",
                    hint="Raise IDEMPOTENT_ORDERS['WEBHOOK_RETENTION'] above it.",
                    id="idempotent_orders.W051",
                )
            )
    return errors
