"""The relay: due pending rows locked (or leased), published and marked sent, in batches.

:func:`relay_outbox` is the general path (every due row, keyed rows in their
key's order); :func:`_publish_unkeyed` is the publisher thread's path for rows
without an order key (one statement to lock, or on SQLite to claim with a lease, and
one to mark: :class:`_Statements`). Both publish a batch through :func:`_publish_rows`, which
hands each row to :mod:`~idempotent_orders.outbox.sender` and each failure to
:mod:`~idempotent_orders.outbox.failures`. :class:`OutboxListener` wakes
``relay_outbox --loop`` when a row is inserted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import DatabaseError, connections, router, transaction
from django.db.models import Exists, Min, OuterRef, Q
from django.utils import timezone

from idempotent_orders.conf import conf
from idempotent_orders.models import OutboxMessage, OutboxStatus
from idempotent_orders.outbox import failures, sender
from idempotent_orders.signals import outbox_relayed
from idempotent_orders.vendors import vendor

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
    if failures.breaker.paused():
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
        # The commit need not wait for the WAL flush: a mark lost in a server crash
        # only makes the row be published again, with the same id (consumers dedup).
        vendor(connection).relax_commit(connection)
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
    if _claims_at_once(db) and len(candidates) > 1:
        rows = _claim_at_once(db, [pk for pk, _ in candidates], until)
    else:
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
    kept = {row.pk for row in heads}
    held = [row.pk for row in rows if row.pk not in kept]
    if held:
        OutboxMessage.objects.using(db).filter(pk__in=held).update(claimed_until=None)
    return _publish_rows(db, heads, full=len(candidates) >= size)


def _claims_at_once(db: str) -> bool:
    """With ``UPDATE ... RETURNING`` (SQLite from 3.35): a batch's claims are one statement."""
    connection = connections[db]
    return vendor(connection).returns_updated(connection)


def _claim_at_once(
    db: str, ids: list[int], until: Any, *, unkeyed: bool = False
) -> list[OutboxMessage]:
    """Claim the rows ``ids`` that are still pending and unclaimed (or their lease ran
    out) with one ``UPDATE ... RETURNING``; the claimed rows, in id order.

    SQLite has one write lock for the whole database: the batch takes it once, for one
    statement, so a consumer committing meanwhile waits once and briefly. The test is the
    one the candidates were read with, made again by the statement on each row: of two
    relays, one wins each row. ``unkeyed`` (the publisher thread's ids, not read first):
    only rows that are due and have no order key, the statement's own test.
    """
    connection = connections[db]
    statements = _statements(db)
    sql, params = statements.claim(ids, unkeyed=unkeyed)
    now = connection.ops.adapt_datetimefield_value(timezone.now())
    lease = connection.ops.adapt_datetimefield_value(until)
    tested = [OutboxStatus.PENDING, now, now] if unkeyed else [OutboxStatus.PENDING, now]
    with connection.cursor() as cursor:
        cursor.execute(sql, [lease, *params, *tested])
        rows = statements.rows(db, cursor.fetchall())
    return sorted(rows, key=lambda row: row.pk)


def _publish_rows(db: str, rows: list[OutboxMessage], *, full: bool) -> Batch:
    """Publish ``rows``; (sent, failed, dead, whether another batch may find rows).

    Another batch is worth it when this one was full, or when it published a
    keyed row: the next row of that key may be due now.
    """
    sent: list[int] = []
    keyed = False
    failed = dead = 0
    with sender._batch_producer(len(rows)) as producer:
        cache = getattr(sender._batch, "templates", None)
        templated = sender._TemplateSender(producer, cache) if producer is not None else None
        # The publisher thread (``keep``) runs beside a consumer in the same process: it
        # hands the GIL over between rows, so that a consumer whose answer came back
        # does not wait for the rest of the batch's Python (up to the switch interval).
        polite = getattr(sender._batch, "keep", False)
        for position, row in enumerate(rows):
            if polite and position:
                time.sleep(0)
            if failures.breaker.paused():
                # Tripped by an earlier row: the rest wait for the broker, unclaimed.
                rest = [r.pk for r in rows[position:]]
                OutboxMessage.objects.using(db).filter(pk__in=rest).update(claimed_until=None)
                break
            try:
                if templated is None or not templated.send(row):
                    sender._send(row)
            except Exception as exc:
                if failures._failed(db, row, exc):
                    dead += 1
                else:
                    failed += 1
            else:
                sent.append(row.pk)
                keyed = keyed or row.order_key is not None
    if sent:
        failures.breaker.close()
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
        self.claim_head = f"UPDATE {table} SET {column['claimed_until']} = %s WHERE {column['id']}"
        lease_over = (
            f" ({column['claimed_until']} IS NULL OR {column['claimed_until']} < %s)"
            f" RETURNING {', '.join(column[f.name] for f in fields)}"
        )
        self.claim_tail = f" AND {column['status']} = %s AND" + lease_over
        self.claim_unkeyed_tail = (
            f" AND {column['status']} = %s AND {column['available_at']} <= %s"
            f" AND {column['order_key']} IS NULL AND" + lease_over
        )
        #: PostgreSQL: the ids as one array literal, cast to the key's type (the driver's
        #: own dumping of a list of ints, element by element, costs more than the statement).
        self.array = (
            f"::{meta.pk.cast_db_type(connection)}[]"
            if vendor(connection).arrays and meta.pk is not None
            else None
        )
        self.converters = []
        for field in fields:
            col = field.get_col(meta.db_table)
            found = connection.ops.get_db_converters(col) + col.get_db_converters(connection)
            self.converters.append((found, col))

    def lock(self, ids: list[int]) -> tuple[str, list[Any]]:
        """The lock statement for rows ``ids``, and its id parameters (then status, now)."""
        sql, params = self._in(ids)
        return self.lock_head + sql + self.lock_tail, params

    def claim(self, ids: list[int], *, unkeyed: bool = False) -> tuple[str, list[Any]]:
        """The leased claim of rows ``ids`` (SQLite), and its id parameters (after the
        lease's end; then status, now; ``unkeyed``: status, now, now, and only due rows
        without an order key)."""
        sql, params = self._in(ids)
        tail = self.claim_unkeyed_tail if unkeyed else self.claim_tail
        return self.claim_head + sql + tail, params

    def mark(self, ids: list[int]) -> tuple[str, list[Any]]:
        """The mark statement for rows ``ids``, and its id parameters (after status, now)."""
        sql, params = self._in(ids)
        return self.mark_head + sql, params

    def _in(self, ids: list[int]) -> tuple[str, list[Any]]:
        if self.array:  # one statement text whatever the count: the driver's cache keeps it
            return f" = ANY(%s{self.array})", ["{" + ",".join(map(str, map(int, ids))) + "}"]
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
    key = (db, vendor(connections[db]).name)
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
    relay holds or that is not due: the relay publishes those. On SQLite (no SKIP
    LOCKED, ``UPDATE ... RETURNING``) the same rows are claimed with a lease by one
    statement, without the read :func:`relay_outbox` makes first; elsewhere without
    SKIP LOCKED it is :func:`relay_outbox`.
    """
    connection = connections[db]
    features = connection.features
    if not (features.has_select_for_update and features.has_select_for_update_skip_locked):
        if not _claims_at_once(db):
            return relay_outbox(ids=ids, using=db)
        if failures.breaker.paused():
            return _relayed(0, 0, 0)  # the broker is away: the rows wait, untouched
        until = timezone.now() + timedelta(seconds=conf.OUTBOX_CLAIM_TIMEOUT)
        rows = _claim_at_once(db, ids, until, unkeyed=True)
        published, retried, dead, _ = _publish_rows(db, rows, full=False)
        return _relayed(published, retried, dead)
    statements = _statements(db)
    with transaction.atomic(using=db):
        vendor(connection).relax_commit(connection)  # as in _relay_locked_batch
        with connection.cursor() as cursor:
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


#: PostgreSQL channel notified on every insert into the outbox (a trigger of 0001_initial).
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
        if not vendor(connection).notifies:
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
