"""Settings of idempotent_orders, read from ``settings.IDEMPOTENT_ORDERS``: each value once,
and again after any ``setting_changed`` (``override_settings``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

#: The Django setting naming the order model, like ``AUTH_USER_MODEL`` names the user model.
ORDER_MODEL_SETTING = "IDEMPOTENT_ORDERS_ORDER_MODEL"
#: The order model when the setting is absent.
DEFAULT_ORDER_MODEL = "idempotent_orders.Order"


def order_model_label() -> str:
    """``"app_label.ModelName"`` of the order model (``settings.IDEMPOTENT_ORDERS_ORDER_MODEL``)."""
    return str(getattr(settings, ORDER_MODEL_SETTING, DEFAULT_ORDER_MODEL))


#: Every setting with its default. ``settings.IDEMPOTENT_ORDERS`` overrides any of them.
DEFAULTS: dict[str, Any] = {
    # Envelope limits: larger or longer input is rejected with a reason.
    "MAX_MESSAGE_BYTES": 64 * 1024,
    "MAX_MESSAGE_ID_LENGTH": 255,
    # How long processed-message ids are kept (seconds). Must exceed the longest
    # time a broker can redeliver a message (checked by a system check).
    "DEDUP_RETENTION": 7 * 24 * 3600,
    # How many times a transition is re-decided after losing an optimistic-lock race.
    "CONFLICT_RETRIES": 50,
    # Enqueue the fulfilment task (paid -> processing) after a payment is applied.
    "FULFIL_AFTER_PAYMENT": True,
    # Celery retry budget for transient errors (lost connections, serialization failures).
    "TASK_MAX_RETRIES": 10,
    "TASK_RETRY_BACKOFF_MAX": 60,
    # Cache alias (a django-redis cache) that holds distributed locks and their fencing counters.
    "LOCK_CACHE": "default",
    # Outbox: publish right after the writing transaction commits (the relay catches the rest).
    "OUTBOX_PUBLISH_ON_COMMIT": True,
    # That publish runs in a background thread of the process (bounded queue, flushed at
    # exit), so the committing request does not wait for the broker; False: in the caller.
    "OUTBOX_PUBLISHER_THREAD": True,
    # Outbox rows the relay claims per transaction.
    "OUTBOX_BATCH_SIZE": 100,
    # Longest wait (seconds) between publish attempts of a row whose publish failed.
    "OUTBOX_RETRY_BACKOFF_MAX": 300,
    # Failed publishes of an outbox row before it is dead-lettered (status "dead",
    # requeued by an operator); a PermanentPublishError dead-letters it at once.
    "OUTBOX_MAX_ATTEMPTS": 20,
    # Failed runs of an @idempotent function (or task) for one key before its inbox row is
    # dead (not run again until requeued); a PermanentFailure makes it dead at once.
    "IDEMPOTENT_MAX_ATTEMPTS": 10,
    # Claim lease (seconds) on databases without SKIP LOCKED; longer than one batch's publish.
    "OUTBOX_CLAIM_TIMEOUT": 60,
    # Sent outbox rows older than this (seconds) are deleted by purge_outbox.
    "OUTBOX_RETENTION": 7 * 24 * 3600,
    # Fast-path dedup (advisory; the inbox's unique index stays the authority).
    # Seconds a processed id stays in the Bloom filters and Redis (plus the margin).
    "DEDUP_WINDOW": 24 * 3600,
    # Cache alias (django-redis) holding the `processed:` keys; "" switches Redis off.
    "DEDUP_CACHE_ALIAS": "default",
    "DEDUP_REDIS_TTL_MARGIN": 3600,
    # After a Redis error, go straight to the database for this many seconds.
    "DEDUP_REDIS_RETRY_AFTER": 5,
    # Longest wait (seconds) for Redis on one fast-path call (connect, lookup, batch write);
    # past it the database answers and Redis is skipped as after an error.
    "DEDUP_REDIS_TIMEOUT": 0.05,
    # How many ids of messages this process applied, found stale or rejected it keeps,
    # to answer their copies without asking Redis (0: always ask Redis).
    "DEDUP_MEMORY": 20_000,
    # Process-local Bloom filter: one per bucket, each sized for CAPACITY ids.
    "DEDUP_BLOOM": True,
    "DEDUP_BLOOM_CAPACITY": 1_000_000,
    "DEDUP_BLOOM_ERROR_RATE": 0.001,
    "DEDUP_BLOOM_BUCKET_SECONDS": 3600,
    # Read ids other processes recorded at most this often (seconds), each read going
    # back one interval before the previous one; once per OVERLAP seconds a read goes
    # back OVERLAP seconds before the previous such read, for rows that committed late.
    "DEDUP_BLOOM_REFRESH": 5,
    "DEDUP_BLOOM_REFRESH_OVERLAP": 30,
    # Load the window of the inbox into a new process's filter in a background thread,
    # the filter answering "maybe" (ask Redis, then the database) until it is loaded.
    # False: the first lookup loads it before answering (its time grows with the window).
    "DEDUP_BLOOM_WARM_UP_IN_BACKGROUND": True,
    # Keep a snapshot of the filters in the dedup cache (DEDUP_CACHE_ALIAS): a new process
    # loads it and reads only the inbox rows created since, not the whole window.
    "DEDUP_BLOOM_SNAPSHOT": True,
    # One process (of all that share the cache) writes that snapshot at most this often.
    "DEDUP_BLOOM_SNAPSHOT_INTERVAL": 60,
    # Counters are kept per process and added to a Redis hash at most this often.
    "STATS_FLUSH_INTERVAL": 1,
    # Seconds a parked message may wait for its predecessor before it is surfaced.
    "PARKED_TIMEOUT": 3600,
    # Seconds a parked (held) message waits before the admin's dashboard shows it
    # under "held too long", with why it still waits; minutes, well before PARKED_TIMEOUT.
    "PARKED_ATTENTION_AFTER": 300,
    # Leased work with an effect outside the database (see leases.py).
    # A claim is valid this long (seconds) unless a heartbeat extends it.
    "LEASE_SECONDS": 30,
    # How often a running step extends its lease; well under LEASE_SECONDS.
    "HEARTBEAT_SECONDS": 10,
    # The fulfilment step's warehouse client and the reconciler's verifier (dotted paths).
    "FULFILMENT_CLIENT": "idempotent_orders.fulfilment.NullWarehouse",
    "FULFILMENT_VERIFIER": "idempotent_orders.fulfilment.ClientVerifier",
    # The order model's transition the fulfilment step drives; a model without it
    # has no fulfilment step (nothing is queued after payment).
    "FULFILMENT_TRANSITION": "start_processing",
    # Expired leases a row may have (stalls) before the reconciler marks it failed.
    "RECONCILE_MAX_STALLS": 3,
    # Rows the reconciler handles per run.
    "RECONCILE_BATCH_SIZE": 100,
    # Parked messages older than this (seconds) are given up: their inbox row is
    # marked rejected with a reason, so they are kept and explained, not lost.
    "PARKED_RETENTION": 30 * 24 * 3600,
    # Rows deleted per statement by the retention purge.
    "PURGE_BATCH_SIZE": 1000,
    # PostgreSQL only: days of one inbox partition once ``manage.py idempotent_orders_partitions
    # convert`` has made the inbox a table partitioned by ``created_at``; retention
    # then drops whole partitions. 0: one plain table, retention by DELETE.
    "INBOX_PARTITION_DAYS": 0,
    # Partitions kept ready ahead of now by ``idempotent_orders_partitions maintain`` (and purge).
    "INBOX_PARTITIONS_AHEAD": 3,
    # Longest time (seconds) the broker may hold an unacknowledged message before
    # redelivering it, when the check cannot read it from the transport options
    # (RabbitMQ's consumer_timeout, for example). 0 means unknown.
    "BROKER_REDELIVERY_HORIZON": 0,
    # HTTP idempotency (Idempotency-Key header, one-time tokens, forms).
    # Longest accepted key (at most 255, the column size).
    "KEY_MAX_LENGTH": 255,
    # Seconds a key and its stored response are kept (then purged).
    "KEY_TTL": 24 * 3600,
    # Seconds a claim is held without a heartbeat; a heartbeat renews it every third.
    "KEY_LEASE": 30,
    # Live keys (and tokens) one principal may hold; more gets 429.
    "KEY_QUOTA": 1000,
    # Seconds an issued, unused token stays valid.
    "TOKEN_TTL": 3600,
    # Unused tokens one principal may hold (the endpoint answers 429 past it,
    # the template tag drops the principal's oldest unused tokens).
    "TOKEN_QUOTA": 100,
    # New anonymous sessions (cookieless page loads minting a token) one client IP may
    # start per SESSION_RATE_WINDOW seconds, counted in the LOCK_CACHE; more gets 429.
    "SESSION_RATE": 60,
    # Seconds of the SESSION_RATE window (a fixed window per client IP).
    "SESSION_RATE_WINDOW": 60,
    # Largest request body an idempotent view accepts (413 above).
    "MAX_REQUEST_BYTES": 1024 * 1024,
    # Largest response body stored for replay; larger ones are stored without body.
    "MAX_STORED_RESPONSE_BYTES": 1024 * 1024,
    # Response headers stored and replayed (case-insensitive).
    "REPLAY_HEADERS": ["Content-Type", "Content-Language", "Location", "Cache-Control"],
    # Seconds a second form submit waits for the first one before answering 409.
    "FORM_WAIT": 15,
    # Retry-After (seconds) on 409 "still in flight" and 429 answers.
    "RETRY_AFTER": 1,
    # Dotted path of ``callable(request) -> str | None`` naming the request's principal.
    "PRINCIPAL_RESOLVER": "idempotent_orders.http.keys.default_principal",
    # Business-key time window (seconds) of create_order().
    "ORDER_WINDOW": 300,
    # Webhook ingress: provider name (the URL's last segment) -> its settings dict:
    # SCHEME ("stripe", "hmac" or "standard": Standard Webhooks 1.0), SECRET (or
    # SECRETS, a list, for rotation), EVENT_TYPES (provider event type -> message type),
    # TO_MESSAGE (dotted path of
    # callable(event) -> (order_id, payload)), and optional CONSUMER ("payments"),
    # TOLERANCE (seconds, 300), RETRY_HORIZON (seconds; Stripe's default is 3 days),
    # INLINE (consume in the request after storing; default False: a task via the
    # outbox), and for "hmac" SIGNATURE_HEADER, TIMESTAMP_HEADER, ID_FIELD, TYPE_FIELD.
    "WEBHOOKS": {},
    # Requests a webhook endpoint refuses before their signature is verified (bad or no
    # signature, too large) one client address may send one provider per
    # WEBHOOK_REFUSED_RATE_WINDOW seconds, counted in the LOCK_CACHE; each is kept as a
    # rejected row, and past the rate answered 429 and not kept. A signed event is
    # never held back by it.
    "WEBHOOK_REFUSED_RATE": 60,
    # Seconds of the WEBHOOK_REFUSED_RATE window (a fixed window per provider and address).
    "WEBHOOK_REFUSED_RATE_WINDOW": 60,
    # Seconds a consumed (processed) webhook event is kept by the retention purge; failed
    # and queued ones stay until consumed. Keep it above every provider's RETRY_HORIZON:
    # an event id reused for another event is only caught while the first one is kept.
    "WEBHOOK_RETENTION": 30 * 24 * 3600,
    # Seconds a refused webhook request (rejected row) is kept by the retention purge.
    "WEBHOOK_REFUSED_RETENTION": 7 * 24 * 3600,
    # Seconds an order may wait for its payment; past it, a durable timer takes the
    # transition below (written with the order, fired once through the inbox). 0: never.
    "PAYMENT_TIMEOUT": 0,
    "PAYMENT_TIMEOUT_TRANSITION": "expire",
    # Due timers one pass of fire_due_timers fires, and how long (seconds) a pass
    # holds a timer it claimed before another process may fire it too.
    "TIMER_BATCH_SIZE": 100,
    "TIMER_CLAIM_SECONDS": 60,
    # Seconds a fired timer is kept (from its firing) by the retention purge; pending and
    # failed timers stay. Keep it at least DEDUP_RETENTION: once the row is gone,
    # schedule() for the same order, transition and key writes a new timer.
    "TIMER_RETENTION": 30 * 24 * 3600,
    # Who may read /metrics (observability.metrics_view): a request carrying
    # "Authorization: Bearer <METRICS_TOKEN>", or one from an address in METRICS_ALLOW_IPS
    # (addresses or networks, matched against REMOTE_ADDR). With neither set the view
    # answers 403, except under DEBUG; METRICS_PUBLIC opens it to everyone.
    "METRICS_TOKEN": "",
    "METRICS_ALLOW_IPS": [],
    "METRICS_PUBLIC": False,
}


#: Numeric settings that must be greater than zero: one system check (E036) holds them all.
POSITIVE: frozenset[str] = frozenset(
    {
        "LEASE_SECONDS",
        "DEDUP_REDIS_TIMEOUT",
        "HEARTBEAT_SECONDS",
        "RECONCILE_MAX_STALLS",
        "RECONCILE_BATCH_SIZE",
        "PARKED_RETENTION",
        "PURGE_BATCH_SIZE",
        "INBOX_PARTITIONS_AHEAD",
        "DEDUP_RETENTION",
        "DEDUP_WINDOW",
        "DEDUP_BLOOM_CAPACITY",
        "DEDUP_BLOOM_BUCKET_SECONDS",
        "DEDUP_BLOOM_SNAPSHOT_INTERVAL",
        "PARKED_TIMEOUT",
        "PARKED_ATTENTION_AFTER",
        "KEY_MAX_LENGTH",
        "KEY_TTL",
        "KEY_LEASE",
        "TOKEN_TTL",
        "KEY_QUOTA",
        "TOKEN_QUOTA",
        "SESSION_RATE",
        "SESSION_RATE_WINDOW",
        "MAX_REQUEST_BYTES",
        "ORDER_WINDOW",
        "OUTBOX_BATCH_SIZE",
        "OUTBOX_CLAIM_TIMEOUT",
        "OUTBOX_MAX_ATTEMPTS",
        "OUTBOX_RETENTION",
        "OUTBOX_RETRY_BACKOFF_MAX",
        "IDEMPOTENT_MAX_ATTEMPTS",
        "TIMER_BATCH_SIZE",
        "TIMER_CLAIM_SECONDS",
        "TIMER_RETENTION",
        "WEBHOOK_REFUSED_RATE",
        "WEBHOOK_REFUSED_RATE_WINDOW",
        "WEBHOOK_RETENTION",
        "WEBHOOK_REFUSED_RETENTION",
    }
)


class Settings:
    """Typed accessors; each property reads Django settings when it is used.

    The ``IDEMPOTENT_ORDERS`` dict is looked up once and again after each
    ``setting_changed`` (``override_settings``), not on every access: reading
    a Django setting costs more than some of the work it configures. :data:`conf`
    keeps each plain value (a number, a flag, a text) once read, until then too.
    """

    _user: dict[str, Any] | None = None

    def _get(self, name: str) -> Any:
        user = self._user
        if user is None:
            user = self._user = getattr(settings, "IDEMPOTENT_ORDERS", None) or {}
        return user.get(name, DEFAULTS[name])

    def forget(self, **kwargs: Any) -> None:
        """Read the settings afresh (connected to ``setting_changed``)."""
        self._user = None

    @property
    def MAX_MESSAGE_BYTES(self) -> int:
        return int(self._get("MAX_MESSAGE_BYTES"))

    @property
    def MAX_MESSAGE_ID_LENGTH(self) -> int:
        return int(self._get("MAX_MESSAGE_ID_LENGTH"))

    @property
    def DEDUP_RETENTION(self) -> int:
        return int(self._get("DEDUP_RETENTION"))

    @property
    def CONFLICT_RETRIES(self) -> int:
        return int(self._get("CONFLICT_RETRIES"))

    @property
    def FULFIL_AFTER_PAYMENT(self) -> bool:
        return bool(self._get("FULFIL_AFTER_PAYMENT"))

    @property
    def TASK_MAX_RETRIES(self) -> int:
        return int(self._get("TASK_MAX_RETRIES"))

    @property
    def TASK_RETRY_BACKOFF_MAX(self) -> int:
        return int(self._get("TASK_RETRY_BACKOFF_MAX"))

    @property
    def LOCK_CACHE(self) -> str:
        return str(self._get("LOCK_CACHE"))

    @property
    def OUTBOX_PUBLISH_ON_COMMIT(self) -> bool:
        return bool(self._get("OUTBOX_PUBLISH_ON_COMMIT"))

    @property
    def OUTBOX_PUBLISHER_THREAD(self) -> bool:
        return bool(self._get("OUTBOX_PUBLISHER_THREAD"))

    @property
    def OUTBOX_BATCH_SIZE(self) -> int:
        return int(self._get("OUTBOX_BATCH_SIZE"))

    @property
    def OUTBOX_RETRY_BACKOFF_MAX(self) -> int:
        return int(self._get("OUTBOX_RETRY_BACKOFF_MAX"))

    @property
    def OUTBOX_MAX_ATTEMPTS(self) -> int:
        return int(self._get("OUTBOX_MAX_ATTEMPTS"))

    @property
    def IDEMPOTENT_MAX_ATTEMPTS(self) -> int:
        return int(self._get("IDEMPOTENT_MAX_ATTEMPTS"))

    @property
    def OUTBOX_CLAIM_TIMEOUT(self) -> int:
        return int(self._get("OUTBOX_CLAIM_TIMEOUT"))

    @property
    def OUTBOX_RETENTION(self) -> int:
        return int(self._get("OUTBOX_RETENTION"))

    @property
    def DEDUP_WINDOW(self) -> int:
        return int(self._get("DEDUP_WINDOW"))

    @property
    def DEDUP_CACHE_ALIAS(self) -> str:
        return str(self._get("DEDUP_CACHE_ALIAS"))

    @property
    def DEDUP_REDIS_TTL_MARGIN(self) -> int:
        return int(self._get("DEDUP_REDIS_TTL_MARGIN"))

    @property
    def DEDUP_REDIS_RETRY_AFTER(self) -> int:
        return int(self._get("DEDUP_REDIS_RETRY_AFTER"))

    @property
    def DEDUP_REDIS_TIMEOUT(self) -> float:
        return float(self._get("DEDUP_REDIS_TIMEOUT"))

    @property
    def DEDUP_MEMORY(self) -> int:
        return int(self._get("DEDUP_MEMORY"))

    @property
    def DEDUP_BLOOM(self) -> bool:
        return bool(self._get("DEDUP_BLOOM"))

    @property
    def DEDUP_BLOOM_WARM_UP_IN_BACKGROUND(self) -> bool:
        return bool(self._get("DEDUP_BLOOM_WARM_UP_IN_BACKGROUND"))

    @property
    def DEDUP_BLOOM_SNAPSHOT(self) -> bool:
        return bool(self._get("DEDUP_BLOOM_SNAPSHOT"))

    @property
    def DEDUP_BLOOM_SNAPSHOT_INTERVAL(self) -> int:
        return int(self._get("DEDUP_BLOOM_SNAPSHOT_INTERVAL"))

    @property
    def DEDUP_BLOOM_CAPACITY(self) -> int:
        return int(self._get("DEDUP_BLOOM_CAPACITY"))

    @property
    def DEDUP_BLOOM_ERROR_RATE(self) -> float:
        return float(self._get("DEDUP_BLOOM_ERROR_RATE"))

    @property
    def DEDUP_BLOOM_BUCKET_SECONDS(self) -> int:
        return int(self._get("DEDUP_BLOOM_BUCKET_SECONDS"))

    @property
    def DEDUP_BLOOM_REFRESH(self) -> int:
        return int(self._get("DEDUP_BLOOM_REFRESH"))

    @property
    def DEDUP_BLOOM_REFRESH_OVERLAP(self) -> int:
        return int(self._get("DEDUP_BLOOM_REFRESH_OVERLAP"))

    @property
    def STATS_FLUSH_INTERVAL(self) -> int:
        return int(self._get("STATS_FLUSH_INTERVAL"))

    @property
    def PARKED_TIMEOUT(self) -> int:
        return int(self._get("PARKED_TIMEOUT"))

    @property
    def PARKED_ATTENTION_AFTER(self) -> int:
        return int(self._get("PARKED_ATTENTION_AFTER"))

    @property
    def LEASE_SECONDS(self) -> float:
        return float(self._get("LEASE_SECONDS"))

    @property
    def HEARTBEAT_SECONDS(self) -> float:
        return float(self._get("HEARTBEAT_SECONDS"))

    @property
    def FULFILMENT_CLIENT(self) -> str:
        return str(self._get("FULFILMENT_CLIENT"))

    @property
    def FULFILMENT_TRANSITION(self) -> str:
        return str(self._get("FULFILMENT_TRANSITION"))

    @property
    def FULFILMENT_VERIFIER(self) -> str:
        return str(self._get("FULFILMENT_VERIFIER"))

    @property
    def RECONCILE_MAX_STALLS(self) -> int:
        return int(self._get("RECONCILE_MAX_STALLS"))

    @property
    def RECONCILE_BATCH_SIZE(self) -> int:
        return int(self._get("RECONCILE_BATCH_SIZE"))

    @property
    def PARKED_RETENTION(self) -> int:
        return int(self._get("PARKED_RETENTION"))

    @property
    def PURGE_BATCH_SIZE(self) -> int:
        return int(self._get("PURGE_BATCH_SIZE"))

    @property
    def INBOX_PARTITION_DAYS(self) -> int:
        return int(self._get("INBOX_PARTITION_DAYS"))

    @property
    def INBOX_PARTITIONS_AHEAD(self) -> int:
        return int(self._get("INBOX_PARTITIONS_AHEAD"))

    @property
    def BROKER_REDELIVERY_HORIZON(self) -> int:
        return int(self._get("BROKER_REDELIVERY_HORIZON"))

    @property
    def KEY_MAX_LENGTH(self) -> int:
        return int(self._get("KEY_MAX_LENGTH"))

    @property
    def KEY_TTL(self) -> int:
        return int(self._get("KEY_TTL"))

    @property
    def KEY_LEASE(self) -> int:
        return int(self._get("KEY_LEASE"))

    @property
    def KEY_QUOTA(self) -> int:
        return int(self._get("KEY_QUOTA"))

    @property
    def TOKEN_TTL(self) -> int:
        return int(self._get("TOKEN_TTL"))

    @property
    def TOKEN_QUOTA(self) -> int:
        return int(self._get("TOKEN_QUOTA"))

    @property
    def SESSION_RATE(self) -> int:
        return int(self._get("SESSION_RATE"))

    @property
    def SESSION_RATE_WINDOW(self) -> int:
        return int(self._get("SESSION_RATE_WINDOW"))

    @property
    def MAX_REQUEST_BYTES(self) -> int:
        return int(self._get("MAX_REQUEST_BYTES"))

    @property
    def MAX_STORED_RESPONSE_BYTES(self) -> int:
        return int(self._get("MAX_STORED_RESPONSE_BYTES"))

    @property
    def REPLAY_HEADERS(self) -> list[str]:
        return [str(h) for h in self._get("REPLAY_HEADERS")]

    @property
    def FORM_WAIT(self) -> int:
        return int(self._get("FORM_WAIT"))

    @property
    def RETRY_AFTER(self) -> int:
        return int(self._get("RETRY_AFTER"))

    @property
    def PRINCIPAL_RESOLVER(self) -> str:
        return str(self._get("PRINCIPAL_RESOLVER"))

    @property
    def ORDER_WINDOW(self) -> int:
        return int(self._get("ORDER_WINDOW"))

    @property
    def WEBHOOKS(self) -> dict[str, Any]:
        return dict(self._get("WEBHOOKS"))

    @property
    def WEBHOOK_REFUSED_RATE(self) -> int:
        return int(self._get("WEBHOOK_REFUSED_RATE"))

    @property
    def WEBHOOK_REFUSED_RATE_WINDOW(self) -> int:
        return int(self._get("WEBHOOK_REFUSED_RATE_WINDOW"))

    @property
    def WEBHOOK_RETENTION(self) -> int:
        return int(self._get("WEBHOOK_RETENTION"))

    @property
    def WEBHOOK_REFUSED_RETENTION(self) -> int:
        return int(self._get("WEBHOOK_REFUSED_RETENTION"))

    @property
    def PAYMENT_TIMEOUT(self) -> int:
        return int(self._get("PAYMENT_TIMEOUT"))

    @property
    def PAYMENT_TIMEOUT_TRANSITION(self) -> str:
        return str(self._get("PAYMENT_TIMEOUT_TRANSITION"))

    @property
    def TIMER_BATCH_SIZE(self) -> int:
        return int(self._get("TIMER_BATCH_SIZE"))

    @property
    def TIMER_CLAIM_SECONDS(self) -> int:
        return int(self._get("TIMER_CLAIM_SECONDS"))

    @property
    def TIMER_RETENTION(self) -> int:
        return int(self._get("TIMER_RETENTION"))

    @property
    def METRICS_TOKEN(self) -> str:
        return str(self._get("METRICS_TOKEN"))

    @property
    def METRICS_ALLOW_IPS(self) -> list[str]:
        return [str(a) for a in self._get("METRICS_ALLOW_IPS")]

    @property
    def METRICS_PUBLIC(self) -> bool:
        return bool(self._get("METRICS_PUBLIC"))


#: The types of a setting's value that may be kept once read (a list or a dict is built
#: afresh for every reader, who may change it).
_KEPT_TYPES = frozenset({int, bool, str, float, type(None)})


class _Kept:
    """A :class:`Settings` property whose value, once read, is kept on the instance until
    :meth:`_KeptSettings.forget`: the next read is an attribute of the instance, with no
    call (the road reads a few dozen settings a message)."""

    __slots__ = ("name", "read")

    def __init__(self, name: str, read: Callable[[Any], Any]) -> None:
        self.name = name
        self.read = read

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        value = self.read(instance)
        if type(value) in _KEPT_TYPES:
            instance.__dict__[self.name] = value
        return value


class _KeptSettings(Settings):
    """:class:`Settings` whose values are kept once read, until ``setting_changed``."""

    def forget(self, **kwargs: Any) -> None:
        self.__dict__.clear()  # the kept values and the settings dict both


for _name, _accessor in list(vars(Settings).items()):
    if isinstance(_accessor, property) and _accessor.fget is not None:
        setattr(_KeptSettings, _name, _Kept(_name, _accessor.fget))

conf: Settings = _KeptSettings()
setting_changed.connect(conf.forget, dispatch_uid="idempotent_orders.conf.forget")


#: Called when the setting naming the order model, or the installed apps, change:
#: ``get_order_model`` adds the forgetting of its cache (so this module need not
#: import the package's ``__init__``, which imports it).
order_model_listeners: list[Callable[[], None]] = []


def _order_model_changed(setting: str, **kwargs: Any) -> None:
    if setting in (ORDER_MODEL_SETTING, "INSTALLED_APPS"):
        for forget in order_model_listeners:
            forget()


setting_changed.connect(_order_model_changed, dispatch_uid="idempotent_orders.conf.order_model")
