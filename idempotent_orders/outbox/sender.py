"""How a row reaches the broker: the general publish, the batch's templated publish, its producer.

:func:`_send` publishes one row through Celery's ``apply_async`` (or
``send_task``). :class:`_TemplateSender` publishes a batch's rows as copies of one
captured Celery message per (task, options) (:class:`_Template`, taken through
:class:`_Capture`). :func:`_batch_producer` checks one broker producer out of
the pool for a batch (the publisher thread keeps it across batches until
:func:`_release_kept`). Nothing here reads or writes outbox rows' state: the
relay (:mod:`~idempotent_orders.outbox.relay`) does.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from celery import current_app

from idempotent_orders import otel, tracing
from idempotent_orders.models import OutboxMessage

logger = logging.getLogger("idempotent_orders")


#: The broker producer a batch publishes through (one pool checkout per batch, not per row).
_batch = threading.local()


def _send(row: OutboxMessage) -> None:
    """Publish ``row`` through Celery's ``apply_async`` (or ``send_task``): the general path."""
    task = current_app.tasks.get(row.task_name)
    options = {**row.options, "task_id": row.message_id}
    producer = getattr(_batch, "producer", None)
    if producer is not None:
        options["producer"] = producer
    trace = tracing.TraceContext(row.traceparent, row.correlation_id).headers()
    if trace:
        options["headers"] = {**options.get("headers", {}), **trace}
    # An instrumented publish (opentelemetry-instrumentation-celery) is the row's child.
    with otel.attached(row.traceparent):
        if task is not None:  # keeps the task's own routing and options
            task.apply_async(args=(row.payload,), **options)
        else:
            current_app.send_task(row.task_name, args=(row.payload,), **options)


#: Row options a template publishes as ``apply_async`` would; any other falls back to it
#: (eta, countdown and expires are relative to the publish time, links, custom arguments ...).
_TEMPLATE_OPTIONS = frozenset(
    {
        "queue",
        "routing_key",
        "exchange",
        "exchange_type",
        "priority",
        "headers",
        "delivery_mode",
        "time_limit",
        "soft_time_limit",
        "ignore_result",
    }
)

#: Seconds the publisher thread reuses a template across its batches (a change of the app's
#: routes or of a task's options at run time reaches its messages after at most this long).
TEMPLATE_TTL = 1.0

#: The key of the app's settings' verdict in a cache of templates (no (task, options) pair).
_SETTINGS = "settings"

#: The clock a kept template's and settings' lifetime is read on (tests stand in their own).
_monotonic = time.monotonic

#: The task id of the one ``apply_async`` a template is taken from (never published).
_TEMPLATE_ID = "idempotent-orders-outbox-template-id"


class _Template:
    """What ``apply_async`` publishes for one (task, options): all but the row's own fields."""

    def __init__(self, body: tuple[Any, ...], publish: dict[str, Any]) -> None:
        self.embed = body[2]
        self.publish = publish
        self.headers: dict[str, Any] = publish.pop("headers")
        self.root_is_id = self.headers.get("root_id") == _TEMPLATE_ID
        self.declare = publish.pop("declare", None)


class _Capture:
    """A stand-in producer: records the one publish Celery asks of it, sends nothing."""

    def __init__(self, producer: Any) -> None:
        self.connection = producer.connection
        self.published: tuple[Any, dict[str, Any]] | None = None

    def publish(self, body: Any, **kwargs: Any) -> None:
        self.published = (body, kwargs)


class _TemplateSender:
    """Publishes the rows of one batch as Celery's protocol-2 task messages, without
    ``apply_async`` per row.

    For each (task, options) of the batch one ``apply_async`` runs against a
    stand-in producer (:class:`_Capture`): that is Celery's own message (the
    task's routing and options, the app's routes and queues, delivery mode,
    serializer, retry policy, headers) with a placeholder id. Each row then
    publishes a copy with its own ``id``, ``root_id``, ``correlation_id``,
    ``argsrepr``, body and trace headers through the batch's producer; the
    queue is declared once per batch. Anything whose message is not the same
    for every row falls back to :func:`_send`: options outside
    :data:`_TEMPLATE_OPTIONS`, a task or app that overrides ``apply_async`` or
    ``send_task``, routes given as functions (they may read the arguments),
    publish signals with receivers, sent events, eager mode, a result backend
    that acts on every call, a serializer other than JSON or compression.
    ``argsrepr`` is ``repr()`` of the arguments cut to Celery's maximum size
    (Celery's ``saferepr`` also shortens deep nesting); it is for display only.
    """

    def __init__(self, producer: Any, cache: dict[Any, Any] | None = None) -> None:
        self.producer = producer
        self.templates: dict[tuple[str, str], _Template | None] = {}
        #: Templates kept across batches for :data:`TEMPLATE_TTL` seconds (the publisher thread's).
        self.cache = cache
        self.declared: set[tuple[str, str]] = set()
        app = current_app._get_current_object()  # type: ignore[attr-defined]
        self.app = app
        self.maxsize = app.amqp.argsrepr_maxsize
        self.usable = self._app_allows(app, cache)

    @staticmethod
    def _settings_allow(app: Any) -> bool:
        """What the app's settings say (eager mode, sent events, the protocol)."""
        conf = app.conf
        eager_or_events = conf.task_always_eager or conf.task_send_sent_event
        return not eager_or_events and conf.task_protocol == 2

    @classmethod
    def _app_allows(cls, app: Any, cache: dict[Any, Any] | None = None) -> bool:
        from celery import Celery, signals
        from celery.app.routes import MapRoute

        # Each read of Celery's settings walks its layers (about 15 us): with ``cache`` (the
        # publisher thread's) they are read once per :data:`TEMPLATE_TTL`, as the templates
        # are taken; a receiver or a patched method is looked for every batch.
        now = _monotonic()
        kept = None if cache is None else cache.get(_SETTINGS)
        if kept is not None and kept[0] > now and kept[1] is app:
            allowed = kept[2]
        else:
            allowed = cls._settings_allow(app)
            if cache is not None:
                cache[_SETTINGS] = (now + TEMPLATE_TTL, app, allowed)
        if not allowed:
            return False
        if type(app).send_task is not Celery.send_task or "send_task" in vars(app):
            return False
        publish_signals = (signals.before_task_publish, signals.after_task_publish)
        if any(signal.receivers for signal in (*publish_signals, signals.task_sent)):
            return False
        return all(isinstance(route, MapRoute) for route in app.amqp.router.routes)

    def send(self, row: OutboxMessage) -> bool:
        """Publish ``row``; False (nothing sent) when it takes the general path."""
        if not self.usable:
            return False
        key = (row.task_name, _options_key(row.options))
        if key in self.templates:
            template = self.templates[key]
        else:
            template = self.templates[key] = self._kept(key, row)
        if template is None:
            return False
        mid = row.message_id
        headers = {**template.headers, "id": mid, "argsrepr": self._argsrepr(row.payload)}
        if template.root_is_id:
            headers["root_id"] = mid
        if row.traceparent or row.correlation_id:
            headers.update(tracing.TraceContext(row.traceparent, row.correlation_id).headers())
        declare = None
        if key not in self.declared:  # once per batch (kombu caches it per connection too)
            declare = template.declare
            self.declared.add(key)
        self.producer.publish(
            ((row.payload,), {}, template.embed),
            headers=headers,
            correlation_id=mid,
            declare=declare,
            **template.publish,
        )
        return True

    def _argsrepr(self, payload: Any) -> str:
        text = repr((payload,))
        return text if len(text) <= self.maxsize else text[: self.maxsize - 3] + "..."

    def _kept(self, key: tuple[str, str], row: OutboxMessage) -> _Template | None:
        """The template of ``key``: from the cache while fresh, else taken now."""
        now = _monotonic()
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None and hit[0] > now and self._task_allows(row):
                return hit[1]
        template = self._template(row)
        if self.cache is not None:
            self.cache[key] = (now + TEMPLATE_TTL, template)
        return template

    def _task_allows(self, row: OutboxMessage) -> Any:
        """How :func:`_send` would publish ``row`` (``apply_async``, or ``send_task`` for a
        task not registered in this process, as in a relay that does not import the
        tasks); None when a template must not stand in for it.
        """
        from celery import Task as BaseTask

        if not set(row.options) <= _TEMPLATE_OPTIONS:
            return None
        task = self.app.tasks.get(row.task_name)
        if task is None:
            return partial(self.app.send_task, row.task_name)
        if type(task).apply_async is not BaseTask.apply_async or "apply_async" in vars(task):
            return None
        return task.apply_async

    def _template(self, row: OutboxMessage) -> _Template | None:
        from celery.backends.base import Backend

        send = self._task_allows(row)
        if send is None:
            return None
        capture = _Capture(self.producer)  # Celery calls only its publish() and connection
        send(args=(row.payload,), task_id=_TEMPLATE_ID, producer=capture, **row.options)
        if capture.published is None:
            return None
        body, publish = capture.published
        headers = publish.get("headers") or {}
        if not headers.get("ignore_result") and (
            type(self.app.backend).on_task_call is not Backend.on_task_call
        ):
            return None
        plain = (
            isinstance(body, tuple)
            and len(body) == 3
            and body[1] == {}
            and headers.get("eta") is None
            and headers.get("expires") is None
            and headers.get("kwargsrepr") == "{}"
            and publish.get("expiration") is None
            and publish.get("serializer") == "json"
            and not publish.get("compression")
            and publish.get("correlation_id") == _TEMPLATE_ID
            and headers.get("id") == _TEMPLATE_ID
        )
        rest = {k: v for k, v in headers.items() if k not in ("id", "root_id")}
        if not plain or _TEMPLATE_ID in repr(rest) or _TEMPLATE_ID in repr(body[2]):
            return None
        publish.pop("correlation_id")
        return _Template(body, publish)


def _options_key(options: Any) -> str:
    if options == {}:  # most rows: what json.dumps gives, without an encoder made each time
        return "{}"
    return json.dumps(options, sort_keys=True, default=str)


@contextmanager
def _batch_producer(rows: int) -> Iterator[Any]:
    """Check one producer out of the app's pool for a batch; yields it (None without rows).

    Without a broker to connect to it yields None: the rows publish one by one
    (and fail one by one, each with its own backoff) as they would without it.
    In the publisher thread (``_batch.keep``) the checkout is kept for its next
    batches, until it goes idle or a publish fails (:func:`_release_kept`).
    """
    if rows < 1:
        yield None
        return
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    kept = getattr(_batch, "kept", None)
    if kept is not None and kept[0] is not app:
        _release_kept()
        kept = None
    if kept is not None:
        checkout, producer = kept[1], kept[2]
    else:
        try:
            checkout = app.producer_or_acquire()
            producer = checkout.__enter__()
        except Exception:
            yield None
            return
        if getattr(_batch, "keep", False):
            _batch.kept = kept = (app, checkout, producer)
    # The general path (apply_async) of a single row takes its own checkout, as it would alone.
    _batch.producer = producer if rows > 1 else None
    try:
        yield producer
    finally:
        _batch.producer = None
        if kept is None:
            checkout.__exit__(None, None, None)


def _release_kept() -> None:
    """Give the producer the publisher thread kept across batches back to the pool."""
    kept = getattr(_batch, "kept", None)
    _batch.kept = None
    if kept is not None:
        try:
            kept[1].__exit__(None, None, None)
        except Exception:
            logger.debug("outbox: releasing the publisher's producer failed", exc_info=True)
