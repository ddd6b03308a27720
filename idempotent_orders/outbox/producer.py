"""The producer's side: ``publish_on_commit`` writes a row in the caller's transaction.

The row's insert (one ``ON CONFLICT DO NOTHING`` statement on PostgreSQL, a
savepoint elsewhere), and its publish right after commit: handed to the
publisher thread (:mod:`~idempotent_orders.outbox.thread`) or published in the
committing thread through :func:`~idempotent_orders.outbox.relay_outbox`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from celery import Task
from django.db import IntegrityError, connections, router, transaction

from idempotent_orders import otel, tracing
from idempotent_orders.conf import conf
from idempotent_orders.models import OutboxMessage
from idempotent_orders.outbox import relay, thread
from idempotent_orders.vendors import vendor

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
    explicit = traceparent is not None
    traceparent, correlation_id = _trace_fields(traceparent, correlation_id)
    # The row stores the context of its send span (opentelemetry-api installed): the
    # consumer's span is that span's child.
    with otel.sending(
        name, traceparent, explicit=explicit, message_id=message_id, message=message
    ) as send:
        fields = {
            "message_id": message_id,
            "task_name": name,
            "payload": message,
            "options": options,
            "order_key": None if order_key is None else str(order_key),
            "traceparent": send.traceparent,
            "correlation_id": correlation_id,
        }
        row, written = _write(db, fields)
        send.outcome("queued" if written else "duplicate")
    if written:
        published_on_commit(db, row.pk, row.order_key is not None)
    return row


def _write(db: str, fields: dict[str, Any]) -> tuple[OutboxMessage, bool]:
    """The row of ``fields``, and whether it was written now (False: it was queued
    already, committed or earlier in this transaction, and that row is returned)."""
    message_id = fields["message_id"]
    conn = connections[db]
    try:
        if vendor(conn).error_aborts_transaction:
            # One statement: a repeated message_id inserts nothing (and raises nothing,
            # so the caller's transaction goes on, with no savepoint around it).
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
        return existing, False
    return row, True


def outbox_row(
    task: Task | str,
    message: Any,
    *,
    message_id: str,
    order_key: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The columns of the row :func:`publish_on_commit` would write, as data (the trace
    context in effect included), for a caller that writes the row in a statement of its
    own (``INSERT ... ON CONFLICT (message_id) DO NOTHING``) and then calls
    :func:`published_on_commit` with the id it got back."""
    traceparent, correlation_id = _trace_fields(None, None)
    return {
        "message_id": str(message_id),
        "task_name": task if isinstance(task, str) else task.name,
        "payload": message,
        "options": options,
        "order_key": None if order_key is None else str(order_key),
        "traceparent": traceparent,
        "correlation_id": correlation_id,
    }


def published_on_commit(db: str, pk: int, keyed: bool = False) -> None:
    """Publish outbox row ``pk``, written in the current transaction, after its commit
    (``OUTBOX_PUBLISH_ON_COMMIT``), as :func:`publish_on_commit` does for its row."""
    if conf.OUTBOX_PUBLISH_ON_COMMIT:
        transaction.on_commit(partial(_publish_after_commit, pk, db, keyed), using=db)


def _trace_fields(traceparent: str | None, correlation_id: Any) -> tuple[str, str]:
    """The row's ``traceparent`` and ``correlation_id``: as given, else the trace in effect."""
    trace = tracing.current() if traceparent is None or correlation_id is None else None
    if traceparent is None:
        traceparent = trace.traceparent if trace else ""
    elif not tracing.valid_traceparent(traceparent):
        raise ValueError(f"not a W3C traceparent: {traceparent!r}")
    if correlation_id is None:
        correlation_id = trace.correlation_id if trace else ""
    return traceparent, str(correlation_id)[:255]


def publish_many_on_commit(
    task: Task | str,
    messages: Sequence[tuple[str, Any]],
    *,
    order_key: str | None = None,
    traceparent: str | None = None,
    correlation_id: str | None = None,
    using: str | None = None,
    **options: Any,
) -> dict[str, int]:
    """:func:`publish_on_commit` for many messages of one task: one INSERT, one hand-off.

    ``messages`` are ``(message_id, message)`` pairs; every row gets the same
    task, options, ``order_key`` and trace context. The rows are written in the
    caller's transaction by one multi-row ``INSERT ... ON CONFLICT (message_id)
    DO NOTHING`` (``INSERT IGNORE`` on MariaDB), in the order given, and after
    commit their ids are handed to the publisher together (or published by one
    :func:`relay_outbox` call). Returns ``{message_id: row id}`` of the rows
    written. A message id already in the outbox (committed, written earlier in
    this transaction, or earlier in ``messages``) is not written again and not
    published again, as with :func:`publish_on_commit`: the row that holds it
    is the message.
    """
    db = using or router.db_for_write(OutboxMessage)
    unique: dict[str, Any] = {}
    for message_id, message in messages:
        unique.setdefault(str(message_id), message)
    if not unique:
        return {}
    name = task if isinstance(task, str) else task.name
    explicit = traceparent is not None
    traceparent, correlation_id = _trace_fields(traceparent, correlation_id)
    # One send span for the rows, whose context they all store.
    with otel.sending(name, traceparent, explicit=explicit, count=len(unique)) as send:
        return _publish_many(db, name, unique, order_key, send, correlation_id, options)


def _publish_many(
    db: str,
    name: str,
    unique: dict[str, Any],
    order_key: str | None,
    send: otel.Sending,
    correlation_id: str,
    options: dict[str, Any],
) -> dict[str, int]:
    conn = connections[db]
    traceparent = send.traceparent
    shared = {
        "task_name": name,
        "options": options,
        "order_key": None if order_key is None else str(order_key),
        "traceparent": traceparent,
        "correlation_id": correlation_id,
    }
    meta = OutboxMessage._meta
    id_length = meta.get_field("message_id").max_length or 255
    too_long = any(
        len(value) > (meta.get_field(key).max_length or 255)  # type: ignore[union-attr]
        for key, value in shared.items()
        if isinstance(value, str)
    ) or any(len(m) > id_length for m in unique)
    if too_long or not conn.features.can_return_rows_from_bulk_insert:
        # The database refuses such a row (MariaDB's INSERT IGNORE would cut it), or
        # cannot return the ids of a multi-row insert: one row at a time, through
        # publish_on_commit().
        written: dict[str, int] = {}
        for message_id, message in unique.items():
            rows_before = OutboxMessage.objects.using(db).filter(message_id=message_id).exists()
            row = publish_on_commit(
                name,
                message,
                message_id=message_id,
                order_key=order_key,
                traceparent=traceparent,
                correlation_id=correlation_id,
                using=db,
                **options,
            )
            if not rows_before:
                written[message_id] = row.pk
        return written
    written = _insert_many_unless_queued(db, shared, unique)
    if written and conf.OUTBOX_PUBLISH_ON_COMMIT:
        transaction.on_commit(
            partial(_publish_many_after_commit, list(written.values()), db, order_key is not None),
            using=db,
        )
    return written


def _insert_many_unless_queued(
    db: str, shared: Mapping[str, Any], messages: Mapping[str, Any]
) -> dict[str, int]:
    """One multi-row insert of ``messages`` with the ``shared`` columns, skipping message ids
    already in the outbox; ``{message_id: id}`` of the rows written, in the order given."""
    conn = connections[db]
    meta = OutboxMessage._meta
    sample = OutboxMessage(message_id="", payload=None, **shared)
    written = [f for f in meta.concrete_fields if not f.primary_key and not f.has_db_default()]
    base = {f.attname: f.get_db_prep_save(f.pre_save(sample, True), conn) for f in written}
    payload_field = meta.get_field("payload")
    qn = conn.ops.quote_name
    pk = meta.pk
    assert pk is not None
    table = qn(meta.db_table)
    columns = ", ".join(qn(str(f.column)) for f in written)
    message_id = qn(str(meta.get_field("message_id").column))
    returning = f"RETURNING {qn(str(pk.column))}, {message_id}"
    ids = list(messages)
    chosen = vendor(conn)
    if chosen.arrays:
        # One array for the message ids and one for the payloads (JSON text); the
        # columns every row shares are one argument each. The statement text is the
        # same for any number of rows.
        # One encoder for them all (``json.dumps(m, cls=...)`` would build one per row).
        encode = (payload_field.encoder or json.JSONEncoder)().encode
        payloads = [encode(m) for m in messages.values()]
        selected: list[str] = []
        params: list[Any] = []
        for f in written:
            if f.attname == "message_id":
                selected.append("v.message_id")
            elif f.attname == "payload":
                selected.append("v.payload")
            else:
                selected.append(f"%s::{f.db_type(conn)}")
                params.append(base[f.attname])
        sql = (
            f"INSERT INTO {table} ({columns}) SELECT {', '.join(selected)}"
            f" FROM unnest(%s::{meta.get_field('message_id').db_type(conn)}[], %s::jsonb[])"
            f" WITH ORDINALITY AS v(message_id, payload, n) ORDER BY v.n"
            f" ON CONFLICT ({message_id}) DO NOTHING {returning}"
        )
        params += [_text_array(ids), _text_array(payloads)]
        with conn.cursor() as cursor:
            cursor.execute(sql, params)
            found = {mid: pk_ for pk_, mid in cursor.fetchall()}
    else:
        rows: list[Any] = []
        for mid, message in messages.items():
            for f in written:
                if f.attname == "message_id":
                    rows.append(mid)
                elif f.attname == "payload":
                    rows.append(f.get_db_prep_save(message, conn))
                else:
                    rows.append(base[f.attname])
        placeholder = "(" + ", ".join(["%s"] * len(written)) + ")"
        values = ", ".join([placeholder] * len(messages))
        # MariaDB's INSERT IGNORE: the lengths were checked above, so a repeated message
        # id is all it skips.
        head, tail = chosen.insert_ignoring(table, columns, message_id)
        sql = f"{head} VALUES {values} {tail} {returning}"
        with conn.cursor() as cursor:
            cursor.execute(sql, rows)
            found = {mid: pk_ for pk_, mid in cursor.fetchall()}
    return {mid: found[mid] for mid in ids if mid in found}


def _text_array(values: Sequence[str]) -> str:
    """``values`` (text) as one PostgreSQL array literal: built in one pass, not adapted
    element by element by the driver."""
    quoted = ('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
    return "{" + ",".join(quoted) + "}"


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


def _publish_many_after_commit(pks: list[int], db: str, keyed: bool = False) -> None:
    """:func:`_publish_after_commit` for the rows of one :func:`publish_many_on_commit`."""
    if conf.OUTBOX_PUBLISHER_THREAD and not connections[db].in_atomic_block:
        submit = thread.publisher.submit
        for pk in pks:
            if not submit(db, pk, keyed):
                logger.debug("outbox: publisher queue full; the relay will send row %s", pk)
        return
    try:
        relay.relay_outbox(ids=pks, using=db)
    except Exception:
        logger.exception(
            "outbox: immediate publish of %d row(s) failed; the relay will retry", len(pks)
        )


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
