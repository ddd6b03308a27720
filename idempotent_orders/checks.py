"""System checks with stable IDs (``idempotent_orders.E0xx`` / ``W0xx``)."""

from __future__ import annotations

from typing import Any, get_origin, get_type_hints

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

from idempotent_orders.conf import DEFAULTS, POSITIVE, Settings


def setting_type(name: str) -> type:
    """The type ``conf`` reads setting ``name`` as: its typed property's return annotation."""
    hint = get_type_hints(getattr(Settings, name).fget)["return"]
    return get_origin(hint) or hint


def accepts(name: str, value: Any) -> bool:
    """Whether ``value`` has the type of setting ``name`` (a float setting takes an int too)."""
    expected = setting_type(name)
    if isinstance(value, bool) and expected is not bool:
        return False
    if expected is float:
        return isinstance(value, int | float)
    return isinstance(value, expected)


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """IDEMPOTENT_ORDERS must be a dict of known names with values of the right type."""
    errors: list[CheckMessage] = []
    user = getattr(settings, "IDEMPOTENT_ORDERS", {})
    if not isinstance(user, dict):
        return [
            Error(
                "settings.IDEMPOTENT_ORDERS must be a dict.",
                id="idempotent_orders.E001",
            )
        ]
    for name, value in user.items():
        if name not in DEFAULTS:
            errors.append(
                Error(
                    f"settings.IDEMPOTENT_ORDERS has an unknown key {name!r}.",
                    hint=f"Known keys: {', '.join(sorted(DEFAULTS))}.",
                    id="idempotent_orders.E002",
                )
            )
            continue
        if not accepts(name, value):
            errors.append(
                Error(
                    f"settings.IDEMPOTENT_ORDERS[{name!r}] must be {setting_type(name).__name__}, "
                    f"got {type(value).__name__}.",
                    id="idempotent_orders.E003",
                )
            )
    return errors


@register(Tags.models)
def check_order_model(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The configured order model exists, has a usable state graph, and binds every message type."""
    from django.core.exceptions import ImproperlyConfigured

    from idempotent_orders import get_order_model
    from idempotent_orders.conf import ORDER_MODEL_SETTING
    from idempotent_orders.consuming import registry as handlers
    from idempotent_orders.consuming.graph import edges, has_transition
    from idempotent_orders.consuming.running import parameters
    from idempotent_orders.exceptions import UnknownTransition
    from idempotent_orders.models import AbstractOrder
    from idempotent_orders.orders import missing_create_fields

    try:
        model = get_order_model()
    except ImproperlyConfigured as exc:
        return [
            Error(str(exc), hint="Set it before the first migrate.", id="idempotent_orders.E040")
        ]
    label = model._meta.label
    if not issubclass(model, AbstractOrder):
        return [
            Error(
                f"{ORDER_MODEL_SETTING} is {label}, which does not subclass "
                "idempotent_orders.models.AbstractOrder.",
                hint="AbstractOrder adds the version, last_seq and has_parked columns "
                "the consumer needs.",
                id="idempotent_orders.E041",
            )
        ]
    try:
        list(edges(model))
    except UnknownTransition as exc:
        return [Error(str(exc), obj=model, id="idempotent_orders.E042")]
    errors: list[CheckMessage] = []
    for handler in handlers.registered():
        if not has_transition(model, handler.transition):
            errors.append(
                Error(
                    f"Message type {handler.message_type!r} drives {handler.transition!r}, "
                    f"which is not a transition of {label}.",
                    hint="Register the type with one of: "
                    + ", ".join(sorted(e.name for e in edges(model))),
                    obj=model,
                    id="idempotent_orders.E043",
                )
            )
    undrivable = []
    for handler in handlers.registered():
        if not has_transition(model, handler.transition):
            continue
        accepted = parameters(model, handler.transition)
        unnamed = sorted(accepted.required - accepted.names)
        if unnamed:
            undrivable.append(
                f"{handler.message_type!r} -> {handler.transition}() "
                f"(positional-only: {', '.join(unnamed)})"
            )
    if undrivable:
        # Only what a message type is bound to is checked; all of it in one message.
        errors.append(
            Error(
                f"{label}: a message cannot call these transitions, whose methods take "
                f"parameters that cannot be passed by name: {'; '.join(undrivable)}.",
                hint="Give the parameters names (drop the '/'), or register the type with "
                "arguments= and a method that takes keyword arguments.",
                obj=model,
                id="idempotent_orders.E044",
            )
        )
    missing = missing_create_fields(model)
    if missing:
        errors.append(
            Warning(
                f"{label} lacks {', '.join(missing)}: create_order() and POST /api/orders/ "
                "answer with a configuration error.",
                hint="Create orders your own way, or add the fields.",
                obj=model,
                id="idempotent_orders.W041",
            )
        )
    return errors


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


#: Settings holding a dotted path that must import (checked by E035).
DOTTED_PATH_SETTINGS = ("FULFILMENT_CLIENT", "FULFILMENT_VERIFIER")
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


def _user_settings() -> dict[str, Any]:
    user = getattr(settings, "IDEMPOTENT_ORDERS", {})
    return user if isinstance(user, dict) else {}


def _well_typed(name: str) -> bool:
    user = _user_settings()
    if name not in user:
        return True
    return accepts(name, user[name])


@register(Tags.compatibility)
def check_setting_values(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Values of the right type must also make sense: paths import, numbers are positive."""
    from django.utils.module_loading import import_string

    from idempotent_orders.conf import conf

    errors: list[CheckMessage] = []
    for name in DOTTED_PATH_SETTINGS:
        if not _well_typed(name):
            continue  # E003 says so already
        path = getattr(conf, name)
        try:
            import_string(path)
        except ImportError as exc:
            errors.append(
                Error(
                    f"settings.IDEMPOTENT_ORDERS[{name!r}] = {path!r} cannot be imported: {exc}",
                    id="idempotent_orders.E035",
                )
            )
    for name in sorted(POSITIVE):
        if _well_typed(name) and (value := getattr(conf, name)) <= 0:
            errors.append(
                Error(
                    f"settings.IDEMPOTENT_ORDERS[{name!r}] must be positive, "
                    f"got {_user_settings().get(name, value)!r}.",
                    id="idempotent_orders.E036",
                )
            )
    if (
        _well_typed("LEASE_SECONDS")
        and _well_typed("HEARTBEAT_SECONDS")
        and conf.HEARTBEAT_SECONDS * 2 > conf.LEASE_SECONDS
    ):
        errors.append(
            Warning(
                "HEARTBEAT_SECONDS is more than half of LEASE_SECONDS: one slow heartbeat "
                "lets a live lease expire and the reconciler take the work over.",
                hint="Make HEARTBEAT_SECONDS at most a third of LEASE_SECONDS.",
                id="idempotent_orders.W030",
            )
        )
    if (
        _well_typed("PARKED_ATTENTION_AFTER")
        and _well_typed("PARKED_TIMEOUT")
        and conf.PARKED_ATTENTION_AFTER > conf.PARKED_TIMEOUT
    ):
        errors.append(
            Warning(
                "PARKED_ATTENTION_AFTER is longer than PARKED_TIMEOUT: the admin's dashboard "
                "shows a held message only after it was already marked overdue.",
                hint="Make PARKED_ATTENTION_AFTER a few minutes, shorter than PARKED_TIMEOUT.",
                id="idempotent_orders.W037",
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
    if not all(_well_typed(n) for n in (*names, "TASK_RETRY_BACKOFF_MAX")):
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

    if not _well_typed("DEDUP_CACHE_ALIAS"):
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


@register(Tags.database)
def check_mysql_isolation(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """MySQL/MariaDB must run READ COMMITTED: a re-read after a lost race must see the winner.

    Under REPEATABLE READ (their default) the re-read inside a retried decision
    returns the old snapshot, so a consumer that lost an optimistic race loops
    on conflicts instead of seeing the winner's state.
    """
    return mysql_isolation_errors(getattr(settings, "DATABASES", {}))


def mysql_isolation_errors(databases: dict[str, Any]) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    for alias, db in databases.items():
        if not str(db.get("ENGINE", "")).endswith("mysql"):
            continue
        level = str((db.get("OPTIONS") or {}).get("isolation_level") or "repeatable read")
        if level.lower().replace("-", " ") != "read committed":
            errors.append(
                Error(
                    f"Database {alias!r} is MySQL/MariaDB with isolation level {level!r}.",
                    hint="Set DATABASES[...]['OPTIONS']['isolation_level'] = 'read committed'.",
                    id="idempotent_orders.E034",
                )
            )
    return errors


@register(Tags.compatibility)
def check_http_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Idempotency-Key settings that cannot work (E020-E029, W020-W029)."""
    from django.utils.module_loading import import_string

    from idempotent_orders.conf import conf

    user = getattr(settings, "IDEMPOTENT_ORDERS", {})
    if not isinstance(user, dict):
        return []  # E001 reports it
    messages: list[CheckMessage] = []
    length = user.get("KEY_MAX_LENGTH")
    if isinstance(length, int) and length > 255:
        messages.append(
            Error(
                "IDEMPOTENT_ORDERS['KEY_MAX_LENGTH'] is at most 255 (the column size).",
                id="idempotent_orders.E021",
            )
        )
    path = user.get("PRINCIPAL_RESOLVER")
    if isinstance(path, str):
        try:
            resolver = import_string(path)
        except ImportError:
            resolver = None
        if not callable(resolver):
            messages.append(
                Error(
                    f"IDEMPOTENT_ORDERS['PRINCIPAL_RESOLVER'] {path!r} is not an importable "
                    "callable.",
                    id="idempotent_orders.E022",
                )
            )
    ttl, lease = user.get("KEY_TTL"), user.get("KEY_LEASE")
    if isinstance(ttl, int) and isinstance(lease, int) and 0 < ttl <= lease:
        messages.append(
            Error(
                "IDEMPOTENT_ORDERS['KEY_TTL'] must exceed KEY_LEASE, or keys expire in flight.",
                id="idempotent_orders.E023",
            )
        )
    if isinstance(user.get("REPLAY_HEADERS"), list) and any(
        str(h).lower() == "set-cookie" for h in conf.REPLAY_HEADERS
    ):
        messages.append(
            Error(
                "IDEMPOTENT_ORDERS['REPLAY_HEADERS'] must not contain Set-Cookie: a replay "
                "would hand one session's cookie to whoever holds the key.",
                id="idempotent_orders.E024",
            )
        )
    middleware = list(getattr(settings, "MIDDLEWARE", []))
    if "django.contrib.sessions.middleware.SessionMiddleware" not in middleware:
        messages.append(
            Warning(
                "SessionMiddleware is not installed: anonymous callers have no principal, "
                "so idempotent views and {% idempotency_token %} answer them 401.",
                id="idempotent_orders.W020",
            )
        )
    return messages


@register(Tags.database)
def check_order_model_history(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """The order model setting was not changed after this app's first migrate (E045).

    Runs where Django checks databases (``migrate`` does, before it would fail with
    an ``InconsistentMigrationHistory`` that does not say why).
    """
    from django.db import DatabaseError, connections
    from django.db.migrations.exceptions import InconsistentMigrationHistory
    from django.db.migrations.loader import MigrationLoader

    from idempotent_orders.conf import ORDER_MODEL_SETTING, order_model_label

    errors: list[CheckMessage] = []
    for alias in databases or ():
        try:
            loader = MigrationLoader(connections[alias], ignore_no_migrations=True)
            loader.check_consistent_history(connections[alias])
        except InconsistentMigrationHistory as exc:
            if "idempotent_orders." not in str(exc):
                continue
            label = order_model_label()
            errors.append(
                Error(
                    f"Database {alias!r}: this app's migrations were applied before those of "
                    f"the order model {label} ({exc}). {ORDER_MODEL_SETTING} was set or changed "
                    "after the first migrate; the app's tables point at the old order table.",
                    hint=(
                        "Either set it back, or unapply this app's migrations and apply them "
                        "again (`manage.py migrate idempotent_orders zero`, then `migrate`: "
                        "the inbox, parked messages, outbox and keys are dropped, so do it "
                        "before going live, or copy them first). See "
                        "docs/own-order-model.md, 'Adopting an existing table'."
                    ),
                    id="idempotent_orders.E045",
                )
            )
        except DatabaseError:
            continue  # an unreachable database: migrate itself reports it
    return errors


@register(Tags.compatibility)
def check_webhooks(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Webhook providers are well formed, and the inbox outlives each provider's retries."""
    from idempotent_orders.conf import conf
    from idempotent_orders.consuming import registry as handlers
    from idempotent_orders.webhooks.config import problems, provider

    if not _well_typed("WEBHOOKS"):
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
                if handlers.get_handler(message_type) is None
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
            and _well_typed("DEDUP_RETENTION")
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
    return errors


@register(Tags.models)
def check_payment_timeout(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A payment timeout names a transition of the order model, and is not negative."""
    from django.core.exceptions import ImproperlyConfigured

    from idempotent_orders import get_order_model
    from idempotent_orders.conf import conf
    from idempotent_orders.consuming.graph import has_transition

    names = ("PAYMENT_TIMEOUT", "PAYMENT_TIMEOUT_TRANSITION")
    if not all(_well_typed(n) for n in names) or conf.PAYMENT_TIMEOUT == 0:
        return []
    if conf.PAYMENT_TIMEOUT < 0:
        return [
            Error(
                "PAYMENT_TIMEOUT must be a number of seconds (0: orders never expire).",
                id="idempotent_orders.E052",
            )
        ]
    try:
        model = get_order_model()
    except ImproperlyConfigured:
        return []  # E040 says so
    if not has_transition(model, conf.PAYMENT_TIMEOUT_TRANSITION):
        return [
            Error(
                f"PAYMENT_TIMEOUT is set, but the order model {model._meta.label} has no "
                f"transition {conf.PAYMENT_TIMEOUT_TRANSITION!r} (PAYMENT_TIMEOUT_TRANSITION) "
                "for its timers to take.",
                hint="Name one of its @transition methods, or set PAYMENT_TIMEOUT to 0.",
                id="idempotent_orders.E052",
            )
        ]
    return []
