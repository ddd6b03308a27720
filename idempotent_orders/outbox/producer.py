"""The producer's side: ``publish_on_commit`` writes a row in the caller's transaction.

The row's insert (one ``ON CONFLICT DO NOTHING`` statement on PostgreSQL, a
savepoint elsewhere), and its publish right after commit: handed to the
publisher thread (:mod:`~idempotent_orders.outbox.thread`) or published in the
committing thread through :func:`~idempotent_orders.outbox.relay_outbox`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from functools import partial
from typing import Any

from celery import Task
from django.db import IntegrityError, connections, router, transaction

from idempotent_orders import tracing
from idempotent_orders.conf import conf
from idempotent_orders.models import OutboxMessage
from idempotent_orders.outbox import relay, thread

logger = logging.getLogger("idempotent_orders")


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
        if not thread.publisher.submit(db, pk, keyed):
            logger.debug("outbox: publisher queue full; the relay will send row %s", pk)
        return
    try:
        relay.relay_outbox(ids=[pk], using=db)
    except Exception:
        # The producer's transaction is committed; the relay will send the row.
        logger.exception("outbox: immediate publish of row %s failed; the relay will retry", pk)
