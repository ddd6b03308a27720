"""Hot statements straight to the driver, prepared once per database session.

:func:`fetch_one` runs a statement on psycopg 3's own cursor (skipping Django's
cursor wrapper, see :func:`driver_cursor`) as a prepared statement of the session
(:func:`_run_prepared`): the server neither parses nor plans it again, which is most
of its own work on a short statement. The one-statement road
(:mod:`~idempotent_orders.consuming.one_statement`) runs its statement here, in
autocommit or, with a follow-up to write, in the follow-up's transaction.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper

try:
    from psycopg import ClientCursor as _DriverCursor
    from psycopg import Connection as _Psycopg
    from psycopg import errors as _errors
    from psycopg.adapt import Transformer as _Transformer
except ImportError:  # psycopg2, or no PostgreSQL driver: Django's cursor always
    _Psycopg = _DriverCursor = _errors = _Transformer = None  # type: ignore[assignment,misc]

__all__ = ["PreparedMissing", "driver_cursor", "fetch_one"]


class PreparedMissing(Exception):
    """In a transaction, the session had lost a prepared statement: the transaction is
    aborted (nothing of it is written); the caller rolls it back and takes another road."""


def driver_cursor(conn: BaseDatabaseWrapper, *, in_transaction: bool = False) -> Any:
    """A cursor of the psycopg 3 connection under ``conn``, or None: use Django's cursor.

    Going straight to the driver skips the cost of Django's cursor wrapper on
    a hot statement, and keeps Django's checks and error mapping as long as
    the caller runs it under ``conn.wrap_database_errors`` (``ensure_connection``
    and ``validate_thread_sharing`` are done here). None whenever something
    must see the query: execute wrappers, query logging (``DEBUG`` or a test
    capturing queries), a health check not yet done in this request, or a
    connection not in autocommit (the statement would run outside Django's
    transaction bookkeeping). With ``in_transaction``, a connection inside Django's
    ``atomic`` block is served too (psycopg opens the transaction Django asked for).
    """
    if _DriverCursor is None:
        return None
    conn.ensure_connection()
    raw = conn.connection
    if (
        not isinstance(raw, _Psycopg)
        or conn.execute_wrappers
        or conn.queries_logged
        or not (conn.autocommit or (in_transaction and conn.in_atomic_block))
        or (
            getattr(conn, "health_check_enabled", False)
            and not getattr(conn, "health_check_done", False)
        )
    ):
        return None
    conn.validate_thread_sharing()
    return _DriverCursor(raw)


def _named(args: Sequence[Any]) -> dict[str, Any]:
    return {f"a{n}": value for n, value in enumerate(args)}


def fetch_one(
    sql: str,
    args: Sequence[Any],
    conn: BaseDatabaseWrapper | None = None,
    *,
    in_transaction: bool = False,
) -> Any:
    """Run ``sql`` on ``conn`` (the default database's) and return its first row.

    ``sql`` names its arguments ``%(a0)s``, ``%(a1)s``, ... by their position
    in ``args`` (an argument may appear more than once). On psycopg 3 the
    statement goes straight to the driver (see :func:`driver_cursor`) as a
    prepared statement of the session (see :func:`_run_prepared`): the server
    neither parses nor plans it again, which is most of its own work on a
    short statement. Otherwise Django's cursor runs it, unprepared.

    ``in_transaction``: the caller holds an ``atomic`` block and rolls it back on
    :class:`PreparedMissing` (a lost prepared statement aborts the transaction, so
    the statement cannot be run again plainly in it).
    """
    conn = conn if conn is not None else connections[DEFAULT_DB_ALIAS]
    cursor = driver_cursor(conn, in_transaction=in_transaction)
    if cursor is None:
        with conn.cursor() as cursor:
            cursor.execute(sql, _named(args))
            return cursor.fetchone()
    raw = conn.connection
    with conn.wrap_database_errors, cursor:
        return _run_prepared(
            raw, cursor, sql, args, _transformer(conn, raw), in_transaction=not conn.autocommit
        )


@dataclass(frozen=True)
class _Prepared:
    name: str
    prepare: str
    #: ``EXECUTE <name>(``: the arguments and ``)`` follow.
    execute: bytes


_prepared_forms: dict[str, _Prepared | None] = {}
#: Per psycopg connection: the statements prepared on it, the ones used on it, and how
#: many times one went missing there.
_prepared_on: weakref.WeakKeyDictionary[Any, tuple[set[str], set[str], list[int]]] = (
    weakref.WeakKeyDictionary()
)
#: A connection whose prepared statements went missing this often stops preparing
#: (e.g. behind a transaction pooler that does not keep them).
_MAX_MISSES = 3
#: The pieces of a statement text: an argument, an escaped ``%``, or a stray ``%``.
_PLACEHOLDER = re.compile(r"%\(a(\d+)\)s|%%|%")


def _prepared_form(sql: str) -> _Prepared | None:
    """``PREPARE`` of ``sql``, named after a hash of its text; None: run it plainly."""
    try:
        return _prepared_forms[sql]
    except KeyError:
        pass

    def parameter(match: re.Match[str]) -> str:
        if match.group(1) is not None:
            return f"${int(match.group(1)) + 1}"
        if match.group(0) == "%%":
            return "%"
        raise ValueError("a % that is neither an argument nor escaped")

    form: _Prepared | None
    try:
        body = _PLACEHOLDER.sub(parameter, sql)
    except ValueError:
        form = None
    else:
        digest = hashlib.blake2b(sql.encode(), digest_size=12).hexdigest()
        name = f"idempotent_orders_{digest}"
        form = _Prepared(name, f"PREPARE {name} AS {body}", f"EXECUTE {name}(".encode())
    _prepared_forms[sql] = form
    return form


#: Per Django connection: its psycopg connection and a Transformer of it (the dumpers it
#: found are kept from one message to the next). Keyed by Django's wrapper, so the value
#: holds no reference to its own key.
_transformers: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def _transformer(conn: Any, raw: Any) -> Any:
    found = _transformers.get(conn)
    if found is None or found[0] is not raw:
        found = _transformers[conn] = (raw, _Transformer(raw))
    return found[1]


def _execute(form: _Prepared, args: Sequence[Any], transformer: Any) -> bytes:
    """``EXECUTE`` of ``form`` with ``args`` as literals.

    ``EXECUTE`` takes no bound parameters, so its arguments are composed into
    the text as the driver's client-side binding composes them
    (``Transformer.as_literal``; the server coerces each to the type it chose
    for that parameter).
    """
    literal = transformer.as_literal
    values = [b"NULL" if value is None else literal(value) for value in args]
    return form.execute + b", ".join(values) + b")"


def _run_prepared(
    raw: Any,
    cursor: Any,
    sql: str,
    args: Sequence[Any],
    transformer: Any,
    *,
    in_transaction: bool = False,
) -> Any:
    """Run ``sql`` as a prepared statement of ``raw``'s session (prepared on its second use).

    The statement is named after a hash of its text, so a name can only ever
    stand for this text, on any server session (a pooler's included). A
    session that lost it (``DISCARD ALL``, a pooler's other server) or whose
    plan no longer fits (a column type changed) runs this message's
    statement unprepared, which is the same statement; the next message
    prepares it again, up to a few misses per connection. In autocommit a failed
    ``EXECUTE`` did nothing; ``in_transaction`` it aborted the transaction:
    :class:`PreparedMissing` is raised for the caller to roll it back.
    """
    form = _prepared_form(sql)
    state = _prepared_on.get(raw)
    if state is None:
        state = _prepared_on[raw] = (set(), set(), [0])
    prepared, used, misses = state
    if form is None or misses[0] >= _MAX_MISSES or form.name not in used:
        # The first use on a connection runs plainly: a connection that serves
        # one message (CONN_MAX_AGE=0, closed after each task) never pays the
        # PREPARE round trip.
        if form is not None:
            used.add(form.name)
        cursor.execute(sql, _named(args))
        return cursor.fetchone()
    try:
        if form.name not in prepared:
            # A session that has it already has this very text under that name.
            with contextlib.suppress(_errors.DuplicatePreparedStatement):
                cursor.execute(form.prepare)
            prepared.add(form.name)
        cursor.execute(_execute(form, args, transformer))
        return cursor.fetchone()
    except (_errors.InvalidSqlStatementName, _errors.FeatureNotSupported):
        prepared.discard(form.name)
        misses[0] += 1
        if in_transaction:
            raise PreparedMissing(form.name) from None
        with contextlib.suppress(_errors.Error):
            cursor.execute(f"DEALLOCATE {form.name}")
    cursor.execute(sql, _named(args))
    return cursor.fetchone()
