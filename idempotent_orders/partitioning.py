"""The inbox partitioned by time on PostgreSQL: conversion, partitions ahead, retention by DROP.

Opt-in (``INBOX_PARTITION_DAYS``). :func:`convert` rebuilds the inbox as a table
partitioned by range of ``created_at``, one partition per period, with a default
partition that keeps rows retention must not drop yet; :func:`maintain` creates
partitions ahead and drops those past the dedup window. A partitioned table's
unique indexes must contain ``created_at``, so ``(message_id, consumer)`` is unique
per partition only; across partitions a trigger on every insert takes a
transaction-level advisory lock on the pair and then looks for it in every
partition with a snapshot taken after the lock (docs/operations.md, "Inbox
partitioning", has the argument). The claim statements filter their rows through
:data:`~idempotent_orders.consuming.sql.CLAIMABLE`, the same test, so a duplicate
is skipped as ``ON CONFLICT DO NOTHING`` skips it; any other insert of a duplicate
fails with ``unique_violation`` as it would on the unique index.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import OperationalError, connections, transaction
from django.db.models import Q

from idempotent_orders.conf import conf
from idempotent_orders.consuming.sql import CLAIMABLE, forget_inbox_shape
from idempotent_orders.models import ProcessedMessage
from idempotent_orders.vendors import vendor

__all__ = [
    "GUARD",
    "Maintenance",
    "Partition",
    "convert",
    "is_partitioned",
    "maintain",
    "partitioned_inbox",
    "partitions",
    "revert",
]

#: Longest wait (ms) for the inbox's exclusive lock when a partition is dropped.
LOCK_TIMEOUT_MS = 500
_LOCK_NOT_AVAILABLE = "55P03"
logger = logging.getLogger("idempotent_orders")

#: The trigger function that keeps ``(message_id, consumer)`` unique across partitions.
GUARD = "io_inbox_claim_guard"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_BOUNDS = re.compile(r"FROM \('([^']+)'\) TO \('([^']+)'\)")


def partitioned_inbox(using: str = "default") -> bool:
    """Whether the settings ask for a partitioned inbox on database ``using``.

    The claims ask the table itself (:func:`~idempotent_orders.consuming.sql.inbox_partitioned`).
    """
    return conf.INBOX_PARTITION_DAYS > 0 and vendor(connections[using]).partitions


@dataclass(frozen=True)
class Partition:
    name: str
    #: None for the default partition (the kept rows).
    start: datetime | None
    end: datetime | None


@dataclass
class Maintenance:
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    #: Rows that went with the dropped partitions.
    dropped_rows: int = 0
    #: Rows of the dropped partitions kept (moved to the default partition).
    kept_rows: int = 0
    #: Partitions past the window left for the next run: the inbox's lock was not free.
    postponed: list[Partition] = field(default_factory=list)


def _names(connection: Any) -> tuple[str, str]:
    """The inbox table's name, and that name quoted."""
    table = ProcessedMessage._meta.db_table
    return table, connection.ops.quote_name(table)


def _column(connection: Any, name: str) -> str:
    return str(connection.ops.quote_name(ProcessedMessage._meta.get_field(name).column))  # type: ignore[union-attr]


def is_partitioned(using: str = "default") -> bool:
    """Whether the inbox table on ``using`` is a partitioned table (PostgreSQL only)."""
    connection = connections[using]
    if not vendor(connection).partitions:
        return False
    table, _ = _names(connection)
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [table])
        row = cursor.fetchone()
    return bool(row) and row[0] == "p"


def partitions(using: str = "default") -> list[Partition]:
    """The inbox's partitions, the default partition first, then by period."""
    connection = connections[using]
    table, _ = _names(connection)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i"
            " JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(%s)",
            [table],
        )
        found = []
        for name, bound in cursor.fetchall():
            match = _BOUNDS.search(bound)
            if match is None:
                found.append(Partition(name, None, None))
            else:
                start, end = (datetime.fromisoformat(b) for b in match.groups())
                found.append(Partition(name, start, end))
    return sorted(found, key=lambda p: (p.start is not None, p.start or _EPOCH))


def period_start(moment: datetime, days: int) -> datetime:
    """The start of the period holding ``moment``: periods of ``days`` counted from 1970 (UTC)."""
    return _EPOCH + timedelta(days=(moment - _EPOCH).days // days * days)


def _partition_name(table: str, start: datetime) -> str:
    return f"{table}_{start:%Y%m%d}"


def _dedup_index(connection: Any, cursor: Any, partition: str) -> None:
    qn = connection.ops.quote_name
    columns = f"{_column(connection, 'message_id')}, {_column(connection, 'consumer')}"
    cursor.execute(f"CREATE UNIQUE INDEX {qn(partition + '_dedup')} ON {qn(partition)} ({columns})")


def _add_partition(connection: Any, cursor: Any, start: datetime, end: datetime) -> str:
    """A partition for [start, end), with the rows of that range the default partition took."""
    table, quoted = _names(connection)
    qn = connection.ops.quote_name
    name = _partition_name(table, start)
    created_at = _column(connection, "created_at")
    # Rows land in the default partition when their period had no partition yet; they
    # move into the new one in the same transaction, or attaching it would fail.
    cursor.execute(f"CREATE TABLE {qn(name)} (LIKE {quoted} INCLUDING DEFAULTS)")
    cursor.execute(
        f"WITH moved AS (DELETE FROM {qn(table + '_kept')} WHERE {created_at} >= %s"
        f" AND {created_at} < %s RETURNING *) INSERT INTO {qn(name)} SELECT * FROM moved",
        [start, end],
    )
    cursor.execute(
        f"ALTER TABLE {quoted} ATTACH PARTITION {qn(name)} FOR VALUES FROM (%s) TO (%s)",
        [start, end],
    )
    _dedup_index(connection, cursor, name)
    return name


def _functions(connection: Any, cursor: Any) -> None:
    """The claim test and the trigger that runs it on every insert into the inbox."""
    _, quoted = _names(connection)
    consumer, message_id = _column(connection, "consumer"), _column(connection, "message_id")
    # Each query of a volatile PL/pgSQL function takes a new snapshot at READ COMMITTED:
    # after the lock, it sees a rival that committed while this statement waited.
    cursor.execute(
        f"CREATE OR REPLACE FUNCTION {CLAIMABLE}(p_consumer text, p_message_id text)"
        " RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$ BEGIN"
        " IF current_setting('transaction_isolation') <> 'read committed' THEN"
        "  RAISE EXCEPTION 'a partitioned inbox is claimed at READ COMMITTED only'"
        "  USING ERRCODE = 'feature_not_supported'; END IF;"
        # A committed first copy needs no lock: rows leave only with their partition.
        f" IF EXISTS (SELECT 1 FROM {quoted} WHERE {message_id} = p_message_id"
        f" AND {consumer} = p_consumer) THEN RETURN false; END IF;"
        " PERFORM pg_advisory_xact_lock(hashtext(p_consumer), hashtext(p_message_id));"
        f" RETURN NOT EXISTS (SELECT 1 FROM {quoted} WHERE {message_id} = p_message_id"
        f" AND {consumer} = p_consumer); END $$"
    )
    cursor.execute(
        f"CREATE OR REPLACE FUNCTION {GUARD}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        f" IF NOT {CLAIMABLE}(NEW.{consumer}, NEW.{message_id}) THEN"
        "  RAISE EXCEPTION 'duplicate inbox row (%, %)', NEW.consumer, NEW.message_id"
        "  USING ERRCODE = 'unique_violation'; END IF;"
        " RETURN NEW; END $$"
    )
    cursor.execute(
        f"CREATE TRIGGER {GUARD} BEFORE INSERT ON {quoted} FOR EACH ROW EXECUTE FUNCTION {GUARD}()"
    )


def _carried(connection: Any, cursor: Any, table: str) -> tuple[list[str], list[str]]:
    """``CREATE INDEX`` and ``ADD CONSTRAINT ... FOREIGN KEY`` text of what a rebuild keeps.

    The primary key and the dedup constraint are left out: they are what changes shape.
    """
    cursor.execute(
        "SELECT pg_get_indexdef(i.indexrelid) FROM pg_index i WHERE i.indrelid = to_regclass(%s)"
        " AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid"
        " AND c.contype IN ('p', 'u'))",
        [table],
    )
    indexes = [row[0] for row in cursor.fetchall()]
    qn = connection.ops.quote_name
    cursor.execute(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint"
        " WHERE conrelid = to_regclass(%s) AND contype = 'f'",
        [table],
    )
    keys = [f"ADD CONSTRAINT {qn(name)} {definition}" for name, definition in cursor.fetchall()]
    return indexes, keys


def _rebuild(connection: Any, cursor: Any, partition_by: str) -> str:
    """Copy the inbox into a new table (``partition_by``: "" or its clause) named in its place.

    Returns the new table's quoted name, not yet renamed.
    """
    table, quoted = _names(connection)
    qn = connection.ops.quote_name
    new = qn(table + "_new")
    cursor.execute(
        f"CREATE TABLE {new} (LIKE {quoted} INCLUDING DEFAULTS INCLUDING IDENTITY) {partition_by}"
    )
    return new


def _finish(connection: Any, cursor: Any, new: str, indexes: list[str], keys: list[str]) -> None:
    _, quoted = _names(connection)
    pk = _column(connection, "id")
    columns = ", ".join(
        connection.ops.quote_name(f.column) for f in ProcessedMessage._meta.concrete_fields
    )
    cursor.execute(f"INSERT INTO {new} ({columns}) SELECT {columns} FROM {quoted}")
    cursor.execute(
        f"SELECT setval(pg_get_serial_sequence(%s, 'id'), COALESCE(MAX({pk}), 0) + 1, false)"
        f" FROM {new}",
        [new],
    )
    cursor.execute(f"DROP TABLE {quoted}")
    cursor.execute(f"ALTER TABLE {new} RENAME TO {quoted}")
    # The index names were the old table's, free again now that it is gone.
    for definition in indexes:
        cursor.execute(definition)
    for key in keys:
        cursor.execute(f"ALTER TABLE {quoted} {key}")


def convert(*, using: str = "default", now: datetime | None = None) -> list[Partition]:
    """Rebuild the inbox as a table partitioned by ``created_at`` (offline: it locks the inbox).

    Partitions cover the oldest row's period to ``INBOX_PARTITIONS_AHEAD`` periods ahead.
    """
    connection = connections[using]
    if not vendor(connection).partitions:
        raise ValueError("only a PostgreSQL inbox can be partitioned")
    days = conf.INBOX_PARTITION_DAYS
    if days <= 0:
        raise ValueError("set IDEMPOTENT_ORDERS['INBOX_PARTITION_DAYS'] first")
    now = now or datetime.now(UTC)
    table, quoted = _names(connection)
    qn = connection.ops.quote_name
    created_at = _column(connection, "created_at")
    with transaction.atomic(using), connection.cursor() as cursor:
        cursor.execute(f"LOCK TABLE {quoted} IN ACCESS EXCLUSIVE MODE")
        if is_partitioned(using):
            return partitions(using)
        indexes, keys = _carried(connection, cursor, table)
        cursor.execute(f"SELECT MIN({created_at}) FROM {quoted}")
        oldest = cursor.fetchone()[0] or now
        new = _rebuild(connection, cursor, f"PARTITION BY RANGE ({created_at})")
        cursor.execute(f"CREATE TABLE {qn(table + '_kept')} PARTITION OF {new} DEFAULT")
        leaves = [table + "_kept"]
        start = period_start(oldest, days)
        last = period_start(now, days) + timedelta(days=days * conf.INBOX_PARTITIONS_AHEAD)
        while start <= last:
            end = start + timedelta(days=days)
            leaves.append(_partition_name(table, start))
            cursor.execute(
                f"CREATE TABLE {qn(leaves[-1])} PARTITION OF {new} FOR VALUES FROM (%s) TO (%s)",
                [start, end],
            )
            start = end
        _finish(connection, cursor, new, indexes, keys)
        cursor.execute(
            f"ALTER TABLE {quoted} ADD CONSTRAINT {qn(table + '_pkey')}"
            f" PRIMARY KEY ({_column(connection, 'id')}, {created_at})"
        )
        for leaf in leaves:
            _dedup_index(connection, cursor, leaf)
        _functions(connection, cursor)
    forget_inbox_shape()
    return partitions(using)


def revert(*, using: str = "default") -> None:
    """Rebuild a partitioned inbox as the one plain table the migrations made."""
    connection = connections[using]
    table, quoted = _names(connection)
    qn = connection.ops.quote_name
    with transaction.atomic(using), connection.cursor() as cursor:
        cursor.execute(f"LOCK TABLE {quoted} IN ACCESS EXCLUSIVE MODE")
        if not is_partitioned(using):
            return
        indexes, keys = _carried(connection, cursor, table)
        new = _rebuild(connection, cursor, "")
        _finish(connection, cursor, new, indexes, keys)
        cursor.execute(f"DROP FUNCTION IF EXISTS {GUARD}() CASCADE")
        cursor.execute(f"DROP FUNCTION IF EXISTS {CLAIMABLE}(text, text)")
        cursor.execute(
            f"ALTER TABLE {quoted} ADD CONSTRAINT {qn(table + '_pkey')}"
            f" PRIMARY KEY ({_column(connection, 'id')})"
        )
        (unique,) = ProcessedMessage._meta.constraints
        columns = ", ".join(_column(connection, name) for name in unique.fields)  # type: ignore[attr-defined]
        cursor.execute(f"ALTER TABLE {quoted} ADD CONSTRAINT {qn(unique.name)} UNIQUE ({columns})")
    forget_inbox_shape()


def _rows(cursor: Any, name: str, qn: Any) -> int:
    """The partition's rows as the planner's statistics have them; counted if never analysed.

    Counting a partition of millions would cost what dropping it saves.
    """
    cursor.execute("SELECT reltuples FROM pg_class WHERE oid = to_regclass(%s)", [name])
    estimate = cursor.fetchone()[0]
    if estimate >= 0:
        return int(estimate)
    cursor.execute(f"SELECT count(*) FROM {qn(name)}")
    return int(cursor.fetchone()[0])


def _drop(
    connection: Any, cursor: Any, name: str, select: str, params: Any, listed: str
) -> tuple[int, int]:
    """Drop partition ``name``, its rows matching ``select`` first copied out and then
    inserted again (into the default partition); returns (kept rows, rows estimated)."""
    _, quoted = _names(connection)
    qn = connection.ops.quote_name
    # While its kept rows are read, only writes to this old partition wait: new rows
    # go to the current one, and the claims' probes only read it.
    cursor.execute(f"LOCK TABLE {qn(name)} IN EXCLUSIVE MODE")
    cursor.execute(f"CREATE TEMPORARY TABLE io_kept ON COMMIT DROP AS {select}", params)
    cursor.execute("SELECT count(*) FROM io_kept")
    kept = int(cursor.fetchone()[0])
    rows = _rows(cursor, name, qn)
    # The inbox itself is locked for the detach only. A claim that holds the inbox
    # and waits for this partition would deadlock with it: give up first, below
    # deadlock_timeout (1 s by default), rather than let the claim be the victim;
    # and a lock waited for long would hold every new claim in its queue.
    cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT_MS}ms'")
    cursor.execute(f"LOCK TABLE {quoted} IN ACCESS EXCLUSIVE MODE")
    cursor.execute("SET LOCAL lock_timeout TO DEFAULT")
    # A row this transaction wrote into the partition still owes its deferred foreign
    # key check, and a table with pending checks cannot be dropped: run them now
    # (Django's foreign keys are all deferred again afterwards).
    cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    cursor.execute(f"ALTER TABLE {quoted} DETACH PARTITION {qn(name)}")
    cursor.execute(f"DROP TABLE {qn(name)}")
    cursor.execute("SET CONSTRAINTS ALL DEFERRED")
    # Its range has no partition now: the kept rows land in the default one.
    cursor.execute(f"INSERT INTO {quoted} ({listed}) SELECT * FROM io_kept")
    return kept, rows


def maintain(*, now: datetime, cutoff: datetime, kept: Q, using: str = "default") -> Maintenance:
    """Create the partitions up to ``INBOX_PARTITIONS_AHEAD`` periods after ``now``'s;
    drop those ending at or before ``cutoff``, moving their rows matching ``kept`` to
    the default partition first (in the drop's transaction: nothing is lost between)."""
    connection = connections[using]
    report = Maintenance()
    days = conf.INBOX_PARTITION_DAYS
    existing = {p.start for p in partitions(using) if p.start is not None}
    start = period_start(now, days)
    for _ in range(conf.INBOX_PARTITIONS_AHEAD + 1):
        end = start + timedelta(days=days)
        if start not in existing:
            with transaction.atomic(using), connection.cursor() as cursor:
                report.created.append(_add_partition(connection, cursor, start, end))
        start = end
    columns = [_column(connection, f.name) for f in ProcessedMessage._meta.concrete_fields]
    listed = ", ".join(columns)
    for partition in partitions(using):
        if partition.end is None or partition.start is None or partition.end > cutoff:
            continue
        keep = ProcessedMessage.objects.using(using).filter(
            kept, created_at__gte=partition.start, created_at__lt=partition.end
        )
        select, params = keep.values_list(
            *(f.attname for f in ProcessedMessage._meta.concrete_fields)
        ).query.sql_with_params()
        try:
            with transaction.atomic(using), connection.cursor() as cursor:
                kept_rows, rows = _drop(connection, cursor, partition.name, select, params, listed)
        except OperationalError as exc:
            if getattr(exc.__cause__, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
                raise
            # Nothing of it happened; the next run tries again.
            logger.warning("inbox partition %s not dropped: the inbox was busy", partition.name)
            report.postponed.append(partition)
            continue
        report.kept_rows += kept_rows
        report.dropped_rows += rows
        report.dropped.append(partition.name)
    report.dropped_rows -= report.kept_rows
    return report
