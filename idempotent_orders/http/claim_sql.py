"""The claim's SQL: one quota-guarded ``INSERT`` per database, prepared where it pays.

:func:`insert_claim` inserts a new key for a claim if its principal is under
``KEY_QUOTA`` (:mod:`idempotent_orders.http.quotas`), in its own committed
statement. Its text is built once per database alias (:class:`_ClaimTexts`):
on PostgreSQL the key's row is read, the principal's advisory lock taken and
the ``INSERT`` run in one round trip, through prepared statements
(:class:`_PreparedClaim`; which session holds them is kept by
:mod:`idempotent_orders.prepared`) on connections that outlive a request; on
MariaDB under a named lock; on SQLite under its single writer; elsewhere by a
count and an insert.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, cast

from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    IntegrityError,
    connections,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper

from idempotent_orders.conf import conf
from idempotent_orders.consuming.sql import build, compiled_read
from idempotent_orders.exceptions import KeyInFlight
from idempotent_orders.http.quotas import live_keys, lock_id, lock_principal
from idempotent_orders.models import IdempotencyKey, KeyQuota
from idempotent_orders.prepared import (
    driver_cursor,
    gave_up,
    hold,
    holds,
    is_duplicate,
    is_missing,
    lose,
    statement,
)
from idempotent_orders.vendors import vendor

try:
    from psycopg import Error as _DriverError
except ImportError:  # psycopg2, or no PostgreSQL driver
    _DriverError = None  # type: ignore[assignment,misc]

__all__ = ["insert_claim"]


#: Columns of a claim's INSERT; the others get their database or literal defaults.
_CLAIM_COLUMNS = (
    "scope",
    "key",
    "principal",
    "method",
    "route",
    "fingerprint",
    "state",
    "lease_owner",
    "lease_expires_at",
    "expires_at",
)


def _field(name: str) -> Any:
    return IdempotencyKey._meta.get_field(name)


@dataclass(frozen=True)
class _Statement:
    """One statement of a claim: its SQL (``%s`` placeholders) and what each one stands for.

    A name is a column of :data:`_CLAIM_COLUMNS`, or ``now``, ``quota`` or ``lock``
    (the advisory lock id); :func:`_claim_params` gives their values.
    """

    sql: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class _ClaimTexts:
    """The SQL of a claim on one database (built once per alias: it never changes)."""

    #: The INSERT guarded by the quota.
    insert: _Statement
    #: PostgreSQL: the advisory lock, taken only if the key has no row.
    lock_if_absent: _Statement
    #: PostgreSQL: the INSERT, skipped too if the key has a row.
    insert_if_absent: _Statement


_claim_texts_by_alias: dict[str, _ClaimTexts] = {}


def _claim_texts(conn: BaseDatabaseWrapper) -> _ClaimTexts:
    found = _claim_texts_by_alias.get(conn.alias)
    if found is not None:
        return found
    chosen = vendor(conn)
    qn = conn.ops.quote_name
    table = qn(IdempotencyKey._meta.db_table)
    columns = ", ".join(qn(c) for c in _CLAIM_COLUMNS)
    values = ", ".join(["%s"] * len(_CLAIM_COLUMNS))
    extra_cols = f"{qn('is_token')}, {qn('body_omitted')}, {qn('response_headers')}"
    extra_vals = f"FALSE, FALSE, {chosen.empty_json_list}"
    count = f"SELECT COUNT(*) FROM {table} WHERE {qn('principal')} = %s AND {qn('expires_at')} > %s"
    absent = f"NOT EXISTS (SELECT 1 FROM {table} WHERE {qn('scope')} = %s AND {qn('key')} = %s)"
    if chosen.claim_lock == "advisory":
        # The principal's bound (KeyQuota) instead of a count of its keys: they are
        # counted only when it has no bound or the bound has reached the quota,
        # and the count then sets the bound. The CTE runs when first read, so not
        # at all below the quota.
        quota = qn(KeyQuota._meta.db_table)
        text = (
            f"WITH live AS MATERIALIZED ({count}), "
            f"held AS MATERIALIZED (SELECT {qn('bound')} FROM {quota}"
            f" WHERE {qn('principal')} = %s), "
            f"claim AS (INSERT INTO {table} ({columns}, {extra_cols}) "
            f"SELECT {values}, {extra_vals} WHERE {{absent}}"
            "(COALESCE((SELECT * FROM held), %s) < %s OR (SELECT * FROM live) < %s) "
            f"ON CONFLICT ({qn('scope')}, {qn('key')}) DO NOTHING RETURNING {qn('id')}), "
            # Without a bound the keys were counted for the guard: the count starts one.
            f"bound AS (INSERT INTO {quota} AS q ({qn('principal')}, {qn('bound')},"
            f" {qn('updated_at')}) SELECT %s, CASE WHEN (SELECT * FROM held) IS NULL"
            " THEN (SELECT * FROM live) + 1 ELSE 1 END, now() FROM claim "
            f"ON CONFLICT ({qn('principal')}) DO UPDATE SET {qn('bound')} ="
            f" CASE WHEN q.{qn('bound')} < %s THEN q.{qn('bound')} + 1"
            f" ELSE (SELECT * FROM live) + 1 END, {qn('updated_at')} = now()) "
            f"SELECT {qn('id')} FROM claim"
        )
        head = ("principal", "now", "principal", *_CLAIM_COLUMNS)
        tail = ("quota", "quota", "quota", "principal", "quota")
        insert = _Statement(text.format(absent=""), (*head, *tail))
        insert_if_absent = _Statement(
            text.format(absent=f"{absent} AND "), (*head, "scope", "key", *tail)
        )
    else:
        into, skip = chosen.insert_ignoring(
            table, f"{columns}, {extra_cols}", f"{qn('scope')}, {qn('key')}"
        )
        sql = (
            f"{into} SELECT {values}, {extra_vals}{chosen.no_table} WHERE ({count}) < %s"
            f" {skip} RETURNING {qn('id')}"
        )
        insert = insert_if_absent = _Statement(sql, (*_CLAIM_COLUMNS, "principal", "now", "quota"))
    found = _claim_texts_by_alias[conn.alias] = _ClaimTexts(
        insert=insert,
        lock_if_absent=_Statement(
            "SELECT pg_advisory_xact_lock(%s),"
            f" set_config('synchronous_commit', 'off', true) WHERE {absent}",
            ("lock", "scope", "key"),
        ),
        insert_if_absent=insert_if_absent,
    )
    return found


#: Columns of a claim holding a date and time; the others hold text.
_CLAIM_MOMENTS = frozenset({"lease_expires_at", "expires_at"})


def _claim_params(conn: BaseDatabaseWrapper, fields: dict[str, Any], now: Any) -> dict[str, Any]:
    """What each name of a :class:`_Statement` stands for, as the database takes it.

    The claim makes the column values itself: strings, which text columns
    take as they are, and aware datetimes, which the backend adapts
    (``get_db_prep_save`` would convert nothing else).
    """
    adapt = conn.ops.adapt_datetimefield_value
    params = {c: adapt(fields[c]) if c in _CLAIM_MOMENTS else fields[c] for c in _CLAIM_COLUMNS}
    params["now"] = adapt(now)
    params["quota"] = conf.KEY_QUOTA
    return params


def insert_claim(fields: dict[str, Any], now: Any) -> int | IdempotencyKey | None:
    """Insert the claim if the key is new and the principal is under quota: its pk, else None.

    On PostgreSQL (one round trip) a key that exists already comes back as its
    row instead, read by the same query before anything else: a replay costs
    one indexed read, takes no lock and counts nothing.

    One ``INSERT ... SELECT ... WHERE <live keys> < quota ON CONFLICT DO NOTHING
    RETURNING`` in its own committed transaction. The quota is exact under
    concurrency because a principal's claims are serialized around it: by a
    transaction-scoped advisory lock on PostgreSQL (the INSERT's snapshot is
    taken after the lock, so it counts every claim committed before), by a
    named lock (``GET_LOCK``) around the autocommitted statement on MariaDB and
    MySQL, and by SQLite's single writer. Other databases take the portable path.
    On PostgreSQL the live keys are counted only when the principal's
    :class:`~idempotent_orders.models.KeyQuota` bound has reached the quota.
    """
    conn = connections[DEFAULT_DB_ALIAS]  # the wrapper: each read through the proxy costs
    chosen = vendor(conn)
    if not chosen.claim_lock or not chosen.returns_inserted(conn):
        return _insert_portable(fields, now)
    texts = _claim_texts(conn)
    values = _claim_params(conn, fields, now)
    if chosen.claim_lock == "advisory":
        values["lock"] = lock_id(fields["principal"])
        if not conn.in_atomic_block and chosen.several_statements(conn):
            # The statements in one simple query: PostgreSQL runs them as one
            # implicit transaction (the lock is held until its end, the INSERT
            # takes a fresh snapshot after it), and rolls it back on an error.
            # That transaction's commit need not wait for its WAL flush: any
            # later synchronous commit (the view's writes, the stored response)
            # flushes it first, so a crash loses the claim only together with
            # everything the view did in the database; other requests see it
            # at once either way. One fsync less per request.
            # The key's row, if it exists, is read first; the lock and the
            # insert then skip themselves (each statement has its own snapshot,
            # so a key inserted meanwhile is still found by ON CONFLICT).
            alias, plan = compiled_read(IdempotencyKey, "scope", "key")
            if plan is None or alias != conn.alias:
                statements = (texts.lock_if_absent, texts.insert)
                with conn.cursor() as cursor:
                    cursor.execute(*_joined(statements, values))
                    cursor.nextset()
                    found = cursor.fetchone()
                return int(found[0]) if found else None
            read = _Statement(plan.sql, ("scope", "key"))
            existing, found = _run_claim(
                conn, (read, texts.lock_if_absent, texts.insert_if_absent), values
            )
            if existing:
                return cast(IdempotencyKey, build(IdempotencyKey, alias, plan, existing[0]))
        else:
            # Inside a caller's transaction: a savepoint, the lock held until
            # that transaction ends, and its durability left as it is.
            with transaction.atomic(using=conn.alias), conn.cursor() as cursor:
                lock_principal(conn, fields["principal"])
                cursor.execute(*_joined((texts.insert,), values))
                found = cursor.fetchone()
    elif chosen.claim_lock == "named":
        name = "io_quota_" + hashlib.sha256(fields["principal"].encode()).hexdigest()[:48]
        with conn.cursor() as cursor:
            cursor.execute("SELECT GET_LOCK(%s, %s)", [name, conf.KEY_LEASE])
            if cursor.fetchone()[0] != 1:
                raise KeyInFlight("too many concurrent claims; retry", retry_after=conf.RETRY_AFTER)
            try:
                cursor.execute(*_joined((texts.insert,), values))
                found = cursor.fetchone()
            finally:
                cursor.execute("SELECT RELEASE_LOCK(%s)", [name])
                cursor.fetchall()
    else:
        with transaction.atomic(using=conn.alias), conn.cursor() as cursor:
            cursor.execute(*_joined((texts.insert,), values))
            found = cursor.fetchone()
    return int(found[0]) if found else None


def _joined(statements: tuple[_Statement, ...], values: dict[str, Any]) -> tuple[str, list[Any]]:
    """One query of ``statements`` and its parameters in placeholder order."""
    return (
        "; ".join(s.sql for s in statements),
        [values[name] for s in statements for name in s.names],
    )


#: The roles of the claim's prepared statements (PostgreSQL), in the order they run.
_CLAIM_STATEMENTS = ("claim_read", "claim_lock", "claim_insert")


@dataclass(frozen=True)
class _PreparedClaim:
    """The claim's statements prepared on a connection, and the query that runs them."""

    #: ``PREPARE`` of each statement, named after its role and a hash of its text
    #: (:func:`~idempotent_orders.prepared.statement`).
    prepares: tuple[str, ...]
    names: tuple[str, ...]
    #: One simple query ``EXECUTE``-ing them all, and the names of its parameters in order.
    execute: str
    order: tuple[str, ...]

    @property
    def prepare_and_execute(self) -> str:
        """The ``PREPARE``s and the ``EXECUTE``s as one simple query (one transaction)."""
        return "; ".join((*self.prepares, self.execute))


#: Per database alias.
_prepared_sql: dict[str, _PreparedClaim] = {}


def _param_type(conn: BaseDatabaseWrapper, name: str) -> str:
    """The SQL type of a claim statement's parameter ``name`` (see :class:`_Statement`)."""
    if name in {"quota", "lock"}:
        return "bigint"
    return str(_field("expires_at" if name == "now" else name).db_type(conn))


def _prepared_claim(
    conn: BaseDatabaseWrapper, statements: tuple[_Statement, ...]
) -> _PreparedClaim:
    """The claim's ``statements`` as prepared statements (each parameter name once)."""
    found = _prepared_sql.get(conn.alias)
    if found is not None:
        return found
    prepares: list[str] = []
    names: list[str] = []
    executes: list[str] = []
    order: list[str] = []
    for role, claim in zip(_CLAIM_STATEMENTS, statements, strict=True):
        distinct = tuple(dict.fromkeys(claim.names))
        parts = claim.sql.split("%s")
        assert len(parts) == len(claim.names) + 1, "one placeholder per name"
        numbered = parts[0] + "".join(
            f"${distinct.index(n) + 1}{part}"
            for n, part in zip(claim.names, parts[1:], strict=True)
        )
        prepared = statement(role, numbered, [_param_type(conn, n) for n in distinct])
        prepares.append(prepared.prepare)
        names.append(prepared.name)
        executes.append(f"EXECUTE {prepared.name} ({', '.join(['%s'] * len(distinct))})")
        order.extend(distinct)
    found = _prepared_sql[conn.alias] = _PreparedClaim(
        tuple(prepares), tuple(names), "; ".join(executes), tuple(order)
    )
    return found


def _run_claim(
    conn: BaseDatabaseWrapper, statements: tuple[_Statement, ...], values: dict[str, Any]
) -> tuple[list[Any], Any]:
    """Run the claim's three statements: the key's row if it exists, and the inserted id.

    Straight on the driver's connection where nothing needs to see the query
    (see :func:`~idempotent_orders.prepared.driver_cursor`).
    """
    cursor = driver_cursor(conn)
    if cursor is None:
        with conn.cursor() as cursor:
            return _claim_results(conn, cursor, statements, values)
    with conn.wrap_database_errors, cursor:
        return _claim_results(conn, cursor, statements, values)


def _claim_results(
    conn: BaseDatabaseWrapper,
    cursor: Any,
    statements: tuple[_Statement, ...],
    values: dict[str, Any],
) -> tuple[list[Any], Any]:
    _execute_claim(conn, cursor, statements, values)
    existing = cursor.fetchall()
    cursor.nextset()
    cursor.nextset()
    return existing, cursor.fetchone()


def _execute_claim(
    conn: BaseDatabaseWrapper,
    cursor: Any,
    statements: tuple[_Statement, ...],
    values: dict[str, Any],
) -> None:
    """Run the claim's statements as one simple query, through prepared statements
    where the connection allows them (parsed and planned once per connection).

    The statements are prepared by the query that first runs them (the
    ``PREPARE``s, then the ``EXECUTE``s: one implicit transaction, which a
    transaction pooler such as PgBouncer's runs on one server connection), so
    preparing costs no round trip of its own; later queries send the
    ``EXECUTE``s alone. A session that is not the one the statements were
    prepared on (an ``EXECUTE`` of a missing statement: a transaction pooler
    changed the server connection, or ``DISCARD ALL`` ran) rolls that query
    back whole; it is sent again as text, and the next claim prepares again,
    up to :data:`~idempotent_orders.prepared.MAX_MISSES` misses (counted with the
    consume roads' on the same connection): the connection then sends text for good.
    Which session holds what is :mod:`idempotent_orders.prepared`'s bookkeeping.
    A session that has them already (a pooler's server that another client
    prepared them on, or an earlier query of this one that failed after its
    ``PREPARE``s, which are not rolled back) runs the ``EXECUTE``s alone.

    Text too when the connection does not outlive the request (``CONN_MAX_AGE``
    0 without Django's pool: the prepared statements would die with it), and
    under ``DISABLE_SERVER_SIDE_CURSORS`` (a sign of transaction pooling).
    """
    settings = conn.settings_dict
    raw = conn.connection
    if (
        settings.get("DISABLE_SERVER_SIDE_CURSORS")
        or (settings.get("CONN_MAX_AGE") == 0 and not settings["OPTIONS"].get("pool"))
        or gave_up(raw)
    ):
        cursor.execute(*_joined(statements, values))
        return
    prepared = _prepared_claim(conn, statements)
    params = [values[name] for name in prepared.order]
    if not holds(raw, prepared.names):
        try:
            cursor.execute(prepared.prepare_and_execute, params)
            hold(raw, prepared.names)
            for _ in prepared.prepares:
                cursor.nextset()  # to the first EXECUTE's rows
            return
        except _DB_ERRORS as exc:
            if not is_duplicate(exc):  # already prepared in this server session
                raise
            hold(raw, prepared.names)
    try:
        cursor.execute(prepared.execute, params)
    except _DB_ERRORS as exc:
        if not is_missing(exc):
            raise
        lose(raw, prepared.names)
        cursor.execute(*_joined(statements, values))


#: What a failed statement raises: Django's error, or the driver's own on its cursor.
_DB_ERRORS: tuple[type[Exception], ...] = (
    (DatabaseError,) if _DriverError is None else (DatabaseError, _DriverError)
)


def _insert_portable(fields: dict[str, Any], now: Any) -> int | None:
    """Count, then insert: the quota may be exceeded by claims made at the same instant."""
    if live_keys(fields["principal"], now) >= conf.KEY_QUOTA:
        return None
    try:
        with transaction.atomic():
            return int(IdempotencyKey.objects.create(**fields).pk)
    except IntegrityError:
        return None
