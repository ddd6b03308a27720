"""Transactional outbox: task messages written with the producer's data, published by a relay."""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

from celery import Task, current_app
from django.db import (
    DatabaseError,
    IntegrityError,
    close_old_connections,
    connections,
    router,
    transaction,
)
from django.db.models import Count, Exists, Min, OuterRef, Q
from django.db.models.functions import Now
from django.utils import timezone
from kombu.exceptions import OperationalError as KombuOperationalError

from idempotent_orders import tracing
from idempotent_orders.conf import conf
from idempotent_orders.exceptions import PermanentPublishError
from idempotent_orders.models import OutboxMessage, OutboxStatus
from idempotent_orders.signals import outbox_dead, outbox_relayed

try:  # py-amqp (RabbitMQ): its connection errors are not all OSErrors
    from amqp.exceptions import RecoverableConnectionError as _AmqpRecoverable

    _AMQP_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (_AmqpRecoverable,)
except ImportError:  # pragma: no cover
    _AMQP_CONNECTION_ERRORS = ()

__all__ = [
    "OutboxListener",
    "PermanentPublishError",
    "RelayResult",
    "flush_publisher",
    "outbox_stats",
    "publish_on_commit",
    "purge_outbox",
    "relay_outbox",
    "requeue_outbox",
]

logger = logging.getLogger("idempotent_orders")


@dataclass(frozen=True)
class RelayResult:
    """What one relay run did: rows published, rows whose publish failed and will be
    tried again, rows it left pending, rows dead-lettered.

    ``pending`` counts the rows this run tried and left pending (its failed
    publishes, backing off), not the whole backlog: counting every pending row
    would cost the relay a scan of the table on each run. The backlog is
    ``outbox_stats()["pending"]``.
    """

    published: int = 0
    retried: int = 0
    pending: int = 0
    dead: int = 0


def publish_on_commit(
    task: Task | str,
    message: Any,
    *,
    message_id: str | None = None,
    order_key: str | None = None,
    traceparent: str | None = None,
    correlation_id: str | None = None,
    using: str | None = None,
    **options: Any,
) -> OutboxMessage:
    """Queue ``task(message)`` to be sent if, and only if, the caller's transaction commits.

    The outbox row is written in the current transaction. Its ``message_id``
    (given, else ``message["message_id"]``, else a new UUID) is fixed now and
    becomes the Celery ``task_id`` of every publish of it, so a consumer
    (``@idempotent(key=...)`` or the inbox) recognises a re-publish.

    After commit the row is published at once (``OUTBOX_PUBLISH_ON_COMMIT``):
    handed to this process's background publisher thread
    (``OUTBOX_PUBLISHER_THREAD``), so the committing thread does not wait for
    the broker, or published in the committing thread when that is off. If the
    publish fails, the thread's queue is full or the process dies first,
    :func:`relay_outbox` publishes the row. On PostgreSQL every insert also
    notifies the channel ``idempotent_orders_outbox``, which wakes
    ``relay_outbox --loop``. ``options`` are passed to ``apply_async`` (queue,
    priority, countdown, ...).

    ``order_key`` (an order's id, a customer, ...) keeps the messages of one key
    in order: a row is not published while an earlier row (lower id) of its
    key is pending, backing off or dead. Rows get their ids when written, so
    this is commit order whenever the producers of one key serialise (they
    update the same order row, as transitions do).

    A ``message_id`` already in the outbox (committed, or written earlier in
    this transaction) is not queued again: the existing row is returned as it
    is (its task, payload and options unchanged) and published once; the
    caller's transaction goes on after the repeat (on PostgreSQL the insert is
    ``ON CONFLICT DO NOTHING``; elsewhere, inside a transaction, it runs in a
    savepoint).

    ``traceparent`` (W3C) and ``correlation_id`` default to the trace context in
    effect (:func:`idempotent_orders.tracing.current`: a ``tracing.use()``
    block, the running Celery task's message, OpenTelemetry); they are stored
    with the row and sent as the task's message headers, and restored around
    the consumer's task.
    """
    name = task if isinstance(task, str) else task.name
    if message_id is None and isinstance(message, Mapping):
        message_id = message.get("message_id")
    message_id = str(message_id) if message_id is not None else uuid.uuid4().hex
    db = using or router.db_for_write(OutboxMessage)
    trace = tracing.current() if traceparent is None or correlation_id is None else None
    if traceparent is None:
        traceparent = trace.traceparent if trace else ""
    elif not tracing.valid_traceparent(traceparent):
        raise ValueError(f"not a W3C traceparent: {traceparent!r}")
    if correlation_id is None:
        correlation_id = trace.correlation_id if trace else ""
    fields = {
        "message_id": message_id,
        "task_name": name,
        "payload": message,
        "options": options,
        "order_key": None if order_key is None else str(order_key),
        "traceparent": traceparent,
        "correlation_id": str(correlation_id)[:255],
    }
    conn = connections[db]
    try:
        if conn.vendor == "postgresql":
            # One statement: a repeated message_id inserts nothing (and raises nothing,
            # so the caller's transaction goes on).
            found = _insert_unless_queued(db, fields)
            if found is None:
                raise IntegrityError(f"outbox message {message_id} exists")
            row = found
        elif conn.in_atomic_block:
            # A savepoint: a repeated message_id must not abort the caller's transaction.
            with transaction.atomic(using=db):
                row = OutboxMessage.objects.using(db).create(**fields)
        else:
            row = OutboxMessage.objects.using(db).create(**fields)
    except IntegrityError:
        existing = OutboxMessage.objects.using(db).filter(message_id=message_id).first()
        if existing is None:
            raise
        # The message was queued already (committed, or earlier in this transaction):
        # that row is the message, published once; the repeat changes nothing.
        logger.info("outbox: message %s is queued already; returning its row", message_id)
        return existing
    if conf.OUTBOX_PUBLISH_ON_COMMIT:
        transaction.on_commit(
            partial(_publish_after_commit, row.pk, db, row.order_key is not None), using=db
        )
    return row


def _insert_unless_queued(db: str, fields: Mapping[str, Any]) -> OutboxMessage | None:
    """``INSERT ... ON CONFLICT (message_id) DO NOTHING RETURNING``: the new row, or None."""
    conn = connections[db]
    row = OutboxMessage(**fields)
    meta = OutboxMessage._meta
    written = [f for f in meta.concrete_fields if not f.primary_key and not f.has_db_default()]
    defaulted = [f for f in meta.concrete_fields if f.has_db_default()]
    qn = conn.ops.quote_name
    pk = meta.pk
    assert pk is not None
    returning = ", ".join(qn(str(f.column)) for f in [pk, *defaulted])
    sql = (
        f"INSERT INTO {qn(meta.db_table)} ({', '.join(qn(str(f.column)) for f in written)})"
        f" VALUES ({', '.join(['%s'] * len(written))})"
        f" ON CONFLICT ({qn(str(meta.get_field('message_id').column))}) DO NOTHING"
        f" RETURNING {returning}"
    )
    params = [f.get_db_prep_save(f.pre_save(row, True), conn) for f in written]
    with conn.cursor() as cursor:
        cursor.execute(sql, params)
        found = cursor.fetchone()
    if found is None:
        return None
    for field, value in zip([pk, *defaulted], found, strict=True):
        setattr(row, field.attname, value)
    row._state.adding = False
    row._state.db = db
    return row


def _publish_after_commit(pk: int, db: str, keyed: bool = False) -> None:
    # Inside an atomic block here means the row is not committed for other
    # connections yet (a test case's transaction): the thread could not see it.
    if conf.OUTBOX_PUBLISHER_THREAD and not connections[db].in_atomic_block:
        if not publisher.submit(db, pk, keyed):
            logger.debug("outbox: publisher queue full; the relay will send row %s", pk)
        return
    try:
        relay_outbox(ids=[pk], using=db)
    except Exception:
        # The producer's transaction is committed; the relay will send the row.
        logger.exception("outbox: immediate publish of row %s failed; the relay will retry", pk)


class Publisher:
    """A daemon thread that publishes committed outbox rows for this process.

    Producers hand it row ids after commit (:meth:`submit`: an append, and a
    wake-up only when the thread is idle; never blocking). When ids keep
    coming, the thread waits :attr:`linger` seconds for more, so that one batch publishes
    them all (not when it was idle: a lone id is published at once), then
    locks, publishes and marks them as the relay does (rows
    without an order key through :func:`_publish_unkeyed`, one prepared
    statement each to lock and to mark; keyed rows through
    :func:`relay_outbox`, which keeps their order). Its queue is bounded
    (:attr:`capacity`): a row that does not fit is left to the relay. It is
    started on first use in each process (again after a fork, with an empty
    queue) and flushed at interpreter exit for up to :attr:`exit_timeout`
    seconds; rows it did not reach are still pending, for the relay.
    """

    capacity = 10_000
    exit_timeout = 5.0
    #: Seconds the thread waits, once woken, for more ids to publish them as one batch.
    linger = 0.05
    #: Seconds without work after which the thread closes its database connection.
    idle_close = 1.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        #: (database, row id, whether the row has an order key), in submission order.
        self._pending: deque[tuple[str, int, bool]] = deque()
        #: Set when there is work (or the stop) for an idle thread.
        self._wake = threading.Event()
        #: True from before the thread takes ids until their batch is done.
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._exit_hook = False

    def submit(self, db: str, pk: int, keyed: bool = False) -> bool:
        """Queue row ``pk`` of database ``db``; False when the queue is full.

        ``keyed``: the row has an ``order_key`` (it is published by the path
        that keeps a key's order).
        """
        thread = self._thread
        if thread is None or not thread.is_alive() or self._pid != os.getpid():
            self._ensure_started()
        pending = self._pending
        if len(pending) >= self.capacity:
            return False
        pending.append((db, pk, keyed))
        if not self._wake.is_set():
            self._wake.set()
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted row was handled; False on timeout."""
        deadline = time.monotonic() + timeout
        # Ids leave the queue only after _busy is set: an empty queue, then not busy,
        # means the batch that took the last of them is done.
        while self._pending or self._busy:
            if time.monotonic() >= deadline or not self._alive():
                return False
            time.sleep(0.005)
        return True

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._pid == os.getpid()

    def _ensure_started(self) -> None:
        if self._alive():
            return
        with self._lock:
            if self._alive():
                return
            if self._pid != os.getpid():  # a forked child: the parent's ids are not ours
                self._pending = deque()
                self._wake = threading.Event()
                self._busy = False
            self._pid = os.getpid()
            self._stopping = False
            self._thread = threading.Thread(
                target=self._run, name="idempotent-orders-outbox", daemon=True
            )
            self._thread.start()
            if not self._exit_hook:
                atexit.register(self._stop)
                self._exit_hook = True

    def _stop(self) -> None:
        if self._alive():
            self.flush(self.exit_timeout)
            self._stopping = True
            self._wake.set()
            assert self._thread is not None
            self._thread.join(self.exit_timeout)

    def _run(self) -> None:
        _batch.templates = {}  # this thread's batches reuse their message templates a moment
        _batch.keep = True  # and one producer while ids keep coming
        pending, wake = self._pending, self._wake
        idle = True  # the last round found nothing to do
        finished = float("-inf")  # when the last batch was done (monotonic)
        try:
            while not self._stopping:
                if not pending:
                    idle = True
                    wake.clear()
                    if not pending:  # checked again after the clear: no wake-up is lost
                        if not wake.wait(self.idle_close):
                            connections.close_all()  # idle: hold no database connection
                        continue
                size = conf.OUTBOX_BATCH_SIZE
                # Woken from idle, the first ids go at once (no added latency for a lone
                # message); ids that came while a batch was publishing, or less than
                # ``linger`` after the last batch (a steady stream: one message after
                # another), mean more are coming: wait a moment, and one batch takes them all.
                streaming = not idle or time.monotonic() - finished < self.linger
                if streaming and len(pending) < size and not self._stopping:
                    time.sleep(self.linger)
                idle = False
                self._busy = True
                try:
                    batch = [pending.popleft() for _ in range(min(size, len(pending)))]
                    if not self._publish(batch) or not pending:
                        _release_kept()  # after a failure, or idle: back to the pool
                finally:
                    self._busy = False
                    finished = time.monotonic()
        finally:
            _release_kept()
            connections.close_all()

    def _publish(self, batch: list[tuple[str, int, bool]]) -> bool:
        """Publish ``batch``; False when any publish in it failed."""
        by_db: dict[str, tuple[list[int], list[int]]] = {}
        for db, pk, has_key in batch:
            by_db.setdefault(db, ([], []))[has_key].append(pk)
        close_old_connections()
        ok = True
        for db, (plain, keyed) in by_db.items():
            try:
                results = []
                if plain:
                    results.append(_publish_unkeyed(db, plain))
                if keyed:
                    results.append(relay_outbox(ids=keyed, using=db))
                ok = ok and not any(r.retried or r.dead for r in results)
            except Exception:
                ok = False
                logger.exception(
                    "outbox: background publish of %d row(s) failed; the relay will retry",
                    len(plain) + len(keyed),
                )
        return ok


#: PostgreSQL channel notified on every insert into the outbox (migration 0002_outbox).
NOTIFY_CHANNEL = "idempotent_orders_outbox"


class OutboxListener:
    """Waits for new outbox rows: ``LISTEN`` on PostgreSQL, a plain sleep elsewhere.

    :meth:`wait` returns when a row was inserted (and committed) or after
    ``timeout`` seconds, whichever comes first; ``relay_outbox --loop`` runs
    the relay after each wait. Uses the database connection of ``using``
    (outside any transaction, as a management command is).
    """

    def __init__(self, using: str | None = None) -> None:
        self.db = using or router.db_for_write(OutboxMessage)
        self._listening = False

    def _listen(self) -> bool:
        connection = connections[self.db]
        if connection.vendor != "postgresql":
            return False
        if not self._listening:
            with connection.cursor() as cursor:
                cursor.execute(f"LISTEN {NOTIFY_CHANNEL}")
            self._listening = True
        return True

    def wait(self, timeout: float) -> bool:
        """True when woken by a notification, False after ``timeout`` (or without LISTEN)."""
        try:
            if not self._listen():
                time.sleep(timeout)
                return False
            raw = connections[self.db].connection
            woken = False
            for _ in raw.notifies(timeout=timeout, stop_after=1):
                woken = True
            return woken
        except Exception as exc:
            if not isinstance(exc, (OSError, DatabaseError)) and not _is_driver_error(exc):
                raise
            logger.warning("outbox: LISTEN failed (%r); polling until it works again", exc)
            self.close()
            time.sleep(timeout)
            return False

    def close(self) -> None:
        if self._listening:
            self._listening = False
            connections[self.db].close()


def _is_driver_error(exc: Exception) -> bool:
    return type(exc).__module__.startswith("psycopg")


#: The process's background publisher (see ``OUTBOX_PUBLISHER_THREAD``).
publisher = Publisher()


def flush_publisher(timeout: float = 10.0) -> bool:
    """Wait until the background publisher handled every row handed to it; False on timeout.

    For scripts and tests that want the immediate publishes done before they go on.
    """
    return publisher.flush(timeout)


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
    if task is not None:  # keeps the task's own routing and options
        task.apply_async(args=(row.payload,), **options)
    else:
        current_app.send_task(row.task_name, args=(row.payload,), **options)


#: Row options the fast path publishes as ``apply_async`` would; any other falls back to it
#: (eta, countdown and expires are relative to the publish time, links, custom arguments ...).
_FAST_OPTIONS = frozenset(
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


class _FastSender:
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
    :data:`_FAST_OPTIONS`, a task or app that overrides ``apply_async`` or
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
        self.usable = self._app_allows(app)

    @staticmethod
    def _app_allows(app: Any) -> bool:
        from celery import Celery, signals
        from celery.app.routes import MapRoute

        if app.conf.task_always_eager or app.conf.task_send_sent_event:
            return False
        if type(app).send_task is not Celery.send_task or "send_task" in vars(app):
            return False
        if app.conf.task_protocol != 2:
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
        now = time.monotonic()
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
        tasks); None when the fast path must not stand in for it.
        """
        from celery import Task as BaseTask

        if not set(row.options) <= _FAST_OPTIONS:
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
    return json.dumps(options, sort_keys=True, default=str)


def _backoff(attempts: int) -> timedelta:
    return timedelta(seconds=min(conf.OUTBOX_RETRY_BACKOFF_MAX, 2 ** min(attempts, 20)))


#: Rows that hold back the later rows of their key.
_BLOCKING = (OutboxStatus.PENDING, OutboxStatus.DEAD)


def _due(db: str, ids: list[int] | None) -> Any:
    """Due pending rows that are not behind an earlier pending or dead row of their key."""
    rows = OutboxMessage.objects.using(db).filter(
        status=OutboxStatus.PENDING, available_at__lte=timezone.now()
    )
    earlier = OutboxMessage.objects.using(db).filter(
        order_key=OuterRef("order_key"), status__in=_BLOCKING, pk__lt=OuterRef("pk")
    )
    rows = rows.filter(Q(order_key__isnull=True) | ~Exists(earlier))
    return rows.filter(pk__in=ids) if ids is not None else rows


def _heads(db: str, rows: list[OutboxMessage]) -> list[OutboxMessage]:
    """``rows`` without any that an earlier row of its key still holds back.

    Checked again by a plain read after the rows are locked: the locking read
    may have skipped an earlier row another relay holds (and is publishing).
    """
    keys = {row.order_key for row in rows if row.order_key is not None}
    if not keys:
        return rows
    first = dict(
        OutboxMessage.objects.using(db)
        .filter(order_key__in=keys, status__in=_BLOCKING)
        .values("order_key")
        .annotate(first=Min("id"))
        .values_list("order_key", "first")
    )
    return [row for row in rows if row.order_key is None or first.get(row.order_key) == row.pk]


def relay_outbox(
    *, batch_size: int | None = None, ids: list[int] | None = None, using: str | None = None
) -> RelayResult:
    """Publish every due pending outbox row, each with ``task_id = message_id``; mark it sent.

    Safe to run in several processes at once. On databases with
    ``SELECT ... FOR UPDATE SKIP LOCKED`` (PostgreSQL, MySQL 8, MariaDB 10.6+)
    a batch is locked while it is published and marked in one transaction: a
    crash between publish and mark rolls the mark back, and the next run
    publishes the row again with the same id (at least once; consumers dedup).
    Elsewhere rows are claimed with a lease (``OUTBOX_CLAIM_TIMEOUT``). The rows
    of a batch that were published are marked sent by one ``UPDATE``; on
    PostgreSQL that commit does not wait for the WAL flush (``synchronous_commit
    = off`` for the relay's transaction only), since a mark lost in a server
    crash only means one more publish of the same id.
    """
    db = using or router.db_for_write(OutboxMessage)
    size = batch_size or conf.OUTBOX_BATCH_SIZE
    features = connections[db].features
    locking = features.has_select_for_update and features.has_select_for_update_skip_locked
    published = retried = dead = 0
    if breaker.paused():
        return _relayed(0, 0, 0)  # the broker is away: the rows wait, untouched
    while True:
        if locking:
            sent, failed, died, more = _relay_locked_batch(db, size, ids)
        else:
            sent, failed, died, more = _relay_leased_batch(db, size, ids)
        published += sent
        retried += failed
        dead += died
        if not more:
            break
    return _relayed(published, retried, dead)


Batch = tuple[int, int, int, bool]


def _relay_locked_batch(db: str, size: int, ids: list[int] | None) -> Batch:
    with transaction.atomic(using=db):
        connection = connections[db]
        if connection.vendor == "postgresql":
            # The commit need not wait for the WAL flush: a mark lost in a server crash
            # only makes the row be published again, with the same id (consumers dedup).
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL synchronous_commit TO OFF")
        rows = list(
            _due(db, ids).select_for_update(skip_locked=True).order_by("available_at", "id")[:size]
        )
        return _publish_rows(db, _heads(db, rows), full=len(rows) >= size)


def _relay_leased_batch(db: str, size: int, ids: list[int] | None) -> Batch:
    now = timezone.now()
    until = now + timedelta(seconds=conf.OUTBOX_CLAIM_TIMEOUT)
    candidates = list(
        _due(db, ids)
        .filter(Q(claimed_until__isnull=True) | Q(claimed_until__lt=now))
        .order_by("available_at", "id")
        .values_list("pk", "claimed_until")[:size]
    )
    claimed = []
    for pk, seen in candidates:
        # Conditional on the lease we read: of two relays, one wins each row.
        won = (
            OutboxMessage.objects.using(db)
            .filter(pk=pk, status=OutboxStatus.PENDING, claimed_until=seen)
            .update(claimed_until=until)
        )
        if won:
            claimed.append(pk)
    rows = list(OutboxMessage.objects.using(db).filter(pk__in=claimed).order_by("id"))
    # A row claimed but held back by its key goes back to the pool with its lease lifted.
    heads = _heads(db, rows)
    held = [row.pk for row in rows if row not in heads]
    if held:
        OutboxMessage.objects.using(db).filter(pk__in=held).update(claimed_until=None)
    return _publish_rows(db, heads, full=len(candidates) >= size)


def _publish_rows(db: str, rows: list[OutboxMessage], *, full: bool) -> Batch:
    """Publish ``rows``; (sent, failed, dead, whether another batch may find rows).

    Another batch is worth it when this one was full, or when it published a
    keyed row: the next row of that key may be due now.
    """
    sent: list[int] = []
    keyed = False
    failed = dead = 0
    with _batch_producer(len(rows)) as producer:
        cache = getattr(_batch, "templates", None)
        fast = _FastSender(producer, cache) if producer is not None else None
        for position, row in enumerate(rows):
            if breaker.paused():
                # Tripped by an earlier row: the rest wait for the broker, unclaimed.
                rest = [r.pk for r in rows[position:]]
                OutboxMessage.objects.using(db).filter(pk__in=rest).update(claimed_until=None)
                break
            try:
                if fast is None or not fast.send(row):
                    _send(row)
            except Exception as exc:
                if _failed(db, row, exc):
                    dead += 1
                else:
                    failed += 1
            else:
                sent.append(row.pk)
                keyed = keyed or row.order_key is not None
    if sent:
        breaker.close()
    if sent:  # one statement for the batch, in the transaction that holds its locks
        connection = connections[db]
        sql, params = _statements(db).mark(sent)
        with connection.cursor() as cursor:
            cursor.execute(sql, [OutboxStatus.SENT, _db_now(connection), *params])
    return len(sent), failed, dead, full or keyed


#: What the publisher thread's lock reads of a row: all that a publish, a failure and
#: the signals use.
_ROW_FIELDS = (
    "id",
    "message_id",
    "task_name",
    "payload",
    "options",
    "order_key",
    "traceparent",
    "correlation_id",
    "attempts",
)


class _Statements:
    """The SQL of the publisher thread's lock and of every batch's mark, built once per
    database (only the number of ``IN`` placeholders varies; on PostgreSQL the ids are
    one array parameter), and the converters the ORM would apply to the columns read.
    """

    def __init__(self, db: str) -> None:
        connection = connections[db]
        quote = connection.ops.quote_name
        meta = OutboxMessage._meta
        # In the model's field order: Model.from_db() takes a subset's values in that order.
        fields = [f for f in meta.concrete_fields if f.name in _ROW_FIELDS]
        self.attnames = [f.attname for f in fields]
        column = {f.name: quote(str(f.column)) for f in meta.concrete_fields}
        table = quote(meta.db_table)
        self.lock_head = (
            f"SELECT {', '.join(column[f.name] for f in fields)} FROM {table} WHERE {column['id']}"
        )
        self.lock_tail = (
            f" AND {column['status']} = %s AND {column['available_at']} <= %s"
            f" AND {column['order_key']} IS NULL"
            f" ORDER BY {column['available_at']}, {column['id']}"
            f" {connection.ops.for_update_sql(skip_locked=True)}"
        )
        self.mark_head = (
            f"UPDATE {table} SET {column['status']} = %s, {column['sent_at']} = %s,"
            f" {column['claimed_until']} = NULL WHERE {column['id']}"
        )
        self.array = connection.vendor == "postgresql"
        self.converters = []
        for field in fields:
            col = field.get_col(meta.db_table)
            found = connection.ops.get_db_converters(col) + col.get_db_converters(connection)
            self.converters.append((found, col))

    def lock(self, ids: list[int]) -> tuple[str, list[Any]]:
        """The lock statement for rows ``ids``, and its id parameters (then status, now)."""
        sql, params = self._in(ids)
        return self.lock_head + sql + self.lock_tail, params

    def mark(self, ids: list[int]) -> tuple[str, list[Any]]:
        """The mark statement for rows ``ids``, and its id parameters (after status, now)."""
        sql, params = self._in(ids)
        return self.mark_head + sql, params

    def _in(self, ids: list[int]) -> tuple[str, list[Any]]:
        if self.array:  # one statement text whatever the count: the driver's cache keeps it
            return " = ANY(%s)", [ids]
        return " IN (" + ", ".join(["%s"] * len(ids)) + ")", list(ids)

    def rows(self, db: str, fetched: list[tuple[Any, ...]]) -> list[OutboxMessage]:
        connection = connections[db]
        rows = []
        for values in fetched:
            converted = []
            for value, (converters, col) in zip(values, self.converters, strict=True):
                for convert in converters:
                    value = convert(value, col, connection)
                converted.append(value)
            rows.append(OutboxMessage.from_db(db, self.attnames, converted))
        return rows


_prepared: dict[tuple[str, str], _Statements] = {}


def _statements(db: str) -> _Statements:
    key = (db, connections[db].vendor)
    found = _prepared.get(key)
    if found is None:
        found = _prepared[key] = _Statements(db)
    return found


def _db_now(connection: Any) -> Any:
    """``timezone.now()`` as the database takes a datetime parameter (as the ORM passes it)."""
    return connection.ops.adapt_datetimefield_value(timezone.now())


def _publish_unkeyed(db: str, ids: list[int]) -> RelayResult:
    """Publish the due pending rows among ``ids`` that have no order key: the publisher
    thread's batch.

    As :func:`relay_outbox` (``ids=``) does, locked (``FOR UPDATE SKIP LOCKED``),
    published and marked sent in one transaction, but with one prepared
    statement to lock and one to mark instead of the general query (which
    checks, for keyed rows, the earlier rows of their key). A row that has an
    order key is not read (the guard is in the statement), nor one another
    relay holds or that is not due: the relay publishes those. Without SKIP
    LOCKED it is :func:`relay_outbox`.
    """
    connection = connections[db]
    features = connection.features
    if not (features.has_select_for_update and features.has_select_for_update_skip_locked):
        return relay_outbox(ids=ids, using=db)
    statements = _statements(db)
    with transaction.atomic(using=db):
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":  # as in _relay_locked_batch
                cursor.execute("SET LOCAL synchronous_commit TO OFF")
            sql, params = statements.lock(ids)
            cursor.execute(sql, [*params, OutboxStatus.PENDING, _db_now(connection)])
            rows = statements.rows(db, cursor.fetchall())
        published, retried, dead, _ = _publish_rows(db, rows, full=False)
    return _relayed(published, retried, dead)


def _relayed(published: int, retried: int, dead: int) -> RelayResult:
    result = RelayResult(published=published, retried=retried, pending=retried, dead=dead)
    if published or retried or dead:
        outbox_relayed.send(sender=OutboxMessage, **vars(result))
    return result


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


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the broker could not be reached (not that it refused the row)."""
    if isinstance(exc, PermanentPublishError):
        return False
    if isinstance(exc, ConnectionError | TimeoutError | socket.gaierror | KombuOperationalError):
        return True
    recoverable = _AMQP_CONNECTION_ERRORS
    return bool(recoverable) and isinstance(exc, recoverable)


class Breaker:
    """The relay's circuit breaker for broker outages (one per process).

    A transport error opens it: publishing pauses (the rows stay pending, their
    attempts untouched), an error is logged once per outage, and the pause
    doubles up to :attr:`MAX_PAUSE` while the broker stays away (so the relay
    probes it at least that often, and resumes within that time of its return). The
    first publish after the pause is the probe: a success closes the breaker.
    An outage therefore never spends a row's dead-letter budget.
    """

    #: The longest pause, in seconds (``OUTBOX_RETRY_BACKOFF_MAX`` when that is shorter).
    MAX_PAUSE = 15

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.failures = 0
        self.open_until = 0.0
        self.opened_at: float | None = None

    def paused(self) -> bool:
        return time.monotonic() < self.open_until

    def reset(self) -> None:
        """Closed, with no history (tests; a process that knows the broker is back)."""
        with self._lock:
            self.failures, self.open_until, self.opened_at = 0, 0.0, None

    def trip(self, exc: BaseException) -> float:
        """Open (or keep open) the breaker; the pause, in seconds."""
        with self._lock:
            self.failures += 1
            cap = min(conf.OUTBOX_RETRY_BACKOFF_MAX, self.MAX_PAUSE)
            pause = float(min(cap, 2 ** min(self.failures, 20)))
            self.open_until = time.monotonic() + pause
            first = self.opened_at is None
            if first:
                self.opened_at = time.monotonic()
        if first:
            logger.error(
                "outbox: the broker is unreachable (%r); publishing paused, rows kept pending",
                exc,
            )
        return pause

    def close(self) -> None:
        if self.opened_at is None and not self.failures:
            return
        with self._lock:
            down = time.monotonic() - (self.opened_at or time.monotonic())
            self.failures, self.open_until, self.opened_at = 0, 0.0, None
        logger.warning("outbox: the broker is back after %.0fs; publishing resumed", down)


breaker = Breaker()


def _failed(db: str, row: OutboxMessage, exc: Exception) -> bool:
    """Record a failed publish of ``row``: back off, or dead-letter it; True if dead.

    A transport error (the broker unreachable) trips the :data:`breaker` and keeps
    the row pending with its attempts as they were: only errors of the row's own
    count towards ``OUTBOX_MAX_ATTEMPTS``.
    """
    if is_transport_error(exc):
        pause = breaker.trip(exc)
        row.claimed_until = None
        row.last_error = f"broker unreachable: {type(exc).__name__}: {exc}"[:2000]
        row.available_at = timezone.now() + timedelta(seconds=pause)
        OutboxMessage.objects.using(db).filter(pk=row.pk).update(
            available_at=row.available_at, claimed_until=None, last_error=row.last_error
        )
        return False
    row.attempts += 1
    row.claimed_until = None
    row.last_error = f"{type(exc).__name__}: {exc}"[:2000]
    permanent = isinstance(exc, PermanentPublishError)
    rows = OutboxMessage.objects.using(db).filter(pk=row.pk)
    if permanent or row.attempts >= conf.OUTBOX_MAX_ATTEMPTS:
        row.status = OutboxStatus.DEAD
        row.dead_at = timezone.now()
        rows.update(
            status=row.status,
            attempts=row.attempts,
            claimed_until=None,
            last_error=row.last_error,
            dead_at=row.dead_at,
        )
        logger.error(
            "outbox: %s dead-lettered after %d attempt(s)%s: %r",
            row.message_id,
            row.attempts,
            " (permanent error)" if permanent else "",
            exc,
            extra={"message_id": row.message_id},
        )
        outbox_dead.send(
            sender=OutboxMessage,
            message_id=row.message_id,
            task_name=row.task_name,
            attempts=row.attempts,
            error=row.last_error,
        )
        return True
    row.available_at = timezone.now() + _backoff(row.attempts)
    rows.update(
        attempts=row.attempts,
        available_at=row.available_at,
        claimed_until=None,
        last_error=row.last_error,
    )
    logger.warning(
        "outbox: publishing %s failed (attempt %d of %d): %r",
        row.message_id,
        row.attempts,
        conf.OUTBOX_MAX_ATTEMPTS,
        exc,
        extra={"message_id": row.message_id},
    )
    return False


def requeue_outbox(
    *,
    ids: Iterable[int] | None = None,
    message_ids: Iterable[str] | None = None,
    task_name: str | None = None,
    dry_run: bool = False,
    using: str | None = None,
) -> int:
    """Put dead rows back to pending, due now, with their attempts reset; returns how many.

    Without a filter every dead row is requeued; ``ids``, ``message_ids`` and
    ``task_name`` narrow it down (together: rows matching all of them). Only
    dead rows change (a row that is pending or sent is left alone), and
    ``last_error`` is kept as the record of why it died. ``dry_run`` counts
    the rows and changes nothing.
    """
    db = using or router.db_for_write(OutboxMessage)
    rows = OutboxMessage.objects.using(db).filter(status=OutboxStatus.DEAD)
    if ids is not None:
        rows = rows.filter(pk__in=list(ids))
    if message_ids is not None:
        rows = rows.filter(message_id__in=list(message_ids))
    if task_name is not None:
        rows = rows.filter(task_name=task_name)
    if dry_run:
        return rows.count()
    return rows.update(
        status=OutboxStatus.PENDING,
        attempts=0,
        available_at=Now(),
        claimed_until=None,
        dead_at=None,
    )


def purge_outbox(*, older_than: int | None = None, using: str | None = None) -> int:
    """Delete sent rows older than ``older_than`` seconds (default ``OUTBOX_RETENTION``)."""
    age = conf.OUTBOX_RETENTION if older_than is None else older_than
    cutoff = timezone.now() - timedelta(seconds=age)
    db = using or router.db_for_write(OutboxMessage)
    deleted, _ = (
        OutboxMessage.objects.using(db)
        .filter(status=OutboxStatus.SENT, sent_at__lt=cutoff)
        .delete()
    )
    return deleted


def outbox_stats(*, using: str | None = None) -> dict[str, Any]:
    """Counters for dashboards: pending, sent, dead, retried (rows whose publish failed at
    least once) and the age in seconds of the oldest pending row.
    """
    db = using or router.db_for_write(OutboxMessage)
    rows = OutboxMessage.objects.using(db)
    counts = dict(rows.values_list("status").annotate(n=Count("id")).order_by())
    oldest = rows.filter(status=OutboxStatus.PENDING).aggregate(t=Min("created_at"))["t"]
    return {
        "pending": counts.get(OutboxStatus.PENDING, 0),
        "sent": counts.get(OutboxStatus.SENT, 0),
        "dead": counts.get(OutboxStatus.DEAD, 0),
        "retried": rows.filter(attempts__gt=0).count(),
        # This process's relay paused on a broker outage (see Breaker).
        "broker_paused": breaker.paused(),
        "oldest_pending_age": (timezone.now() - oldest).total_seconds() if oldest else None,
    }
