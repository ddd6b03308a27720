"""Server-side prepared statements (PostgreSQL), and hot statements straight to the driver.

The one place that knows which database session holds which prepared statement. Its
small API, shared by the consume roads and the ``Idempotency-Key`` claim:

- :func:`statement`: a statement's ``PREPARE``, named after its role and a hash of its
  text (a name stands for one text only, on any server session, a pooler's included);
- :func:`holds`, :func:`hold`: whether a raw connection's session holds statements, and
  recording that it does (a caller prepares them in the same text that first runs them);
- :func:`is_missing`, :func:`is_duplicate`: an error saying the session lost a statement
  (``DISCARD ALL``, a transaction pooler's other server) or holds one already;
  :func:`lose` counts such a miss, and :func:`gave_up` says when a connection stops
  preparing (after :data:`MAX_MISSES`) and sends its statements as text for good.

:func:`fetch_one` runs a statement on psycopg 3's own cursor (skipping Django's
cursor wrapper, see :func:`driver_cursor`) as a prepared statement of the session
(:func:`_run_prepared`): the server neither parses nor plans it again, which is most
of its own work on a short statement. In autocommit its arguments are bound by the
protocol (:func:`_execute_bound`), not composed into an ``EXECUTE`` text: no statement
text to build on the client or to parse on the server. The one-statement road
(:mod:`~idempotent_orders.consuming.backends.postgresql.one_statement`) runs its statement here, in
autocommit or, with a follow-up to write, in the follow-up's transaction.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

try:
    from psycopg import ClientCursor as _DriverCursor
    from psycopg import Connection as _Psycopg
    from psycopg import errors as _errors
    from psycopg import generators as _generators
    from psycopg.adapt import PyFormat as _PyFormat
    from psycopg.adapt import Transformer as _Transformer
    from psycopg.pq import ExecStatus as _ExecStatus
except ImportError:  # psycopg2, or no PostgreSQL driver: Django's cursor always
    _Psycopg = _DriverCursor = _errors = _Transformer = None  # type: ignore[assignment,misc]

#: The module of Django's own cursor methods (any other: something patched them).
_DJANGO_CURSORS = CursorWrapper.__module__

__all__ = [
    "MAX_MISSES",
    "PreparedMissing",
    "Statement",
    "driver_cursor",
    "execute_text",
    "fetch_one",
    "gave_up",
    "hold",
    "holds",
    "is_duplicate",
    "is_missing",
    "lose",
    "missed",
    "statement",
]


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
    raw = _driver(conn, in_transaction=in_transaction)
    return None if raw is None else _DriverCursor(raw)


def _driver(conn: BaseDatabaseWrapper, *, in_transaction: bool = False) -> Any:
    """The psycopg 3 connection under ``conn`` when :func:`driver_cursor` would serve it."""
    if _DriverCursor is None:
        return None
    conn.ensure_connection()
    raw = conn.connection
    if (
        not isinstance(raw, _Psycopg)
        or watched(conn)
        or not (conn.autocommit or (in_transaction and conn.in_atomic_block))
        or (
            getattr(conn, "health_check_enabled", False)
            and not getattr(conn, "health_check_done", False)
        )
    ):
        return None
    conn.validate_thread_sharing()
    return raw


def watched(conn: BaseDatabaseWrapper) -> bool:
    """Whether something must see this connection's statements, so that they go through
    Django's cursor and not the driver's: an execute wrapper, query logging (``DEBUG``
    or a test capturing queries), or an error tracker, APM agent or toolbar that patched
    Django's cursor (``CursorWrapper.execute`` replaced, or the connection's ``cursor``)."""
    return bool(
        conn.execute_wrappers
        or conn.queries_logged
        or getattr(CursorWrapper.execute, "__module__", None) != _DJANGO_CURSORS
        or getattr(CursorWrapper.executemany, "__module__", None) != _DJANGO_CURSORS
        or "cursor" in vars(conn)
    )


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
    raw = _driver(conn, in_transaction=in_transaction)
    if raw is None:
        with conn.cursor() as cursor:
            cursor.execute(sql, _named(args))
            return cursor.fetchone()
    with conn.wrap_database_errors:
        return _run_prepared(
            raw, sql, args, _transformer(conn, raw), in_transaction=not conn.autocommit
        )


# -- The shared API: names, sessions, misses ----------------------------------------------


@dataclass(frozen=True)
class Statement:
    """A statement to prepare: its name and its ``PREPARE`` text."""

    name: str
    prepare: str


def statement(role: str, body: str, types: Sequence[str] = ()) -> Statement:
    """``body`` (its parameters ``$1``, ``$2``, ...; of ``types`` where given) as a
    prepared statement named ``idempotent_orders_<role>_<hash>`` (no role:
    ``idempotent_orders_<hash>``), the hash of its text: a name can only ever stand for
    this text, on any server session and across versions of the app sharing one."""
    text = f"({', '.join(types)}) AS {body}" if types else f"AS {body}"
    digest = hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
    name = f"idempotent_orders_{role}_{digest}" if role else f"idempotent_orders_{digest}"
    return Statement(name, f"PREPARE {name} {text}")


@dataclass
class _Session:
    """What is known of a raw connection's server session."""

    #: The statements it holds.
    prepared: set[str] = field(default_factory=set)
    #: The statements :func:`fetch_one` ran on it (plainly, the first time).
    used: set[str] = field(default_factory=set)
    #: How many times a statement it should hold went missing.
    misses: int = 0


#: Per psycopg connection (weakly: a closed connection's session goes with it).
_sessions: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()
#: A connection whose prepared statements went missing this often stops preparing
#: (e.g. behind a transaction pooler that does not keep them).
MAX_MISSES = 3


def _session(raw: Any) -> _Session:
    found = _sessions.get(raw)
    if found is None:
        found = _sessions[raw] = _Session()
    return found


def holds(raw: Any, names: Sequence[str]) -> bool:
    """Whether the session of ``raw`` (a driver connection) holds every one of ``names``."""
    found = _sessions.get(raw)
    return found is not None and found.prepared.issuperset(names)


def hold(raw: Any, names: Sequence[str]) -> None:
    """Record that the session of ``raw`` holds ``names`` (prepared, or found there)."""
    _session(raw).prepared.update(names)


def lose(raw: Any, names: Sequence[str] | set[str]) -> None:
    """A statement the session of ``raw`` should hold was missing: ``names`` are
    prepared again next time, and the miss counts toward :func:`gave_up`."""
    session = _session(raw)
    session.prepared.difference_update(names)
    session.misses += 1


def gave_up(raw: Any) -> bool:
    """Whether ``raw`` missed its statements :data:`MAX_MISSES` times: it sends text for good."""
    found = _sessions.get(raw)
    return found is not None and found.misses >= MAX_MISSES


def _sqlstate(exc: BaseException) -> str | None:
    return getattr(exc, "sqlstate", None) or getattr(exc.__cause__, "sqlstate", None)


def is_missing(exc: BaseException) -> bool:
    """Whether ``exc`` (the driver's, or Django's with the driver's as its cause) says the
    session holds no such prepared statement (SQLSTATE 26000)."""
    return _sqlstate(exc) == "26000"


def is_duplicate(exc: BaseException) -> bool:
    """Whether ``exc`` says the session holds a prepared statement of that name already
    (SQLSTATE 42P05): being named after its text, it is this very statement."""
    return _sqlstate(exc) == "42P05"


# -- One statement run on the driver -------------------------------------------------------


@dataclass(frozen=True)
class _Prepared:
    name: str
    prepare: str
    #: ``EXECUTE <name>(``: the arguments and ``)`` follow.
    execute: bytes
    #: The name as the protocol's Bind message takes it.
    bound: bytes


_prepared_forms: dict[str, _Prepared | None] = {}
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
        named = statement("", body)
        name = named.name
        form = _Prepared(name, named.prepare, f"EXECUTE {name}(".encode(), name.encode())
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


def _send_prepared(raw: Any, name: bytes, params: Sequence[Any]) -> Any:
    """Run prepared statement ``name`` of ``raw``'s session with ``params`` (text, or None
    for NULL) bound by the protocol, in autocommit; its last result."""
    pgconn = raw.pgconn
    with raw.lock:
        pgconn.send_query_prepared(name, params)
        return raw.wait(_generators.execute(pgconn))[-1]


def _execute_bound(raw: Any, form: _Prepared, args: Sequence[Any], transformer: Any) -> Any:
    """The first row of ``form`` run with ``args``, bound by the protocol (Bind, Execute).

    The arguments go as the driver's text form of each value (the server reads each as the
    type it chose for that parameter, as it coerces an ``EXECUTE`` literal), so nothing is
    composed into a statement text or parsed again: the cheaper road of a message on the
    session that prepared the statement. Autocommit only: in a transaction psycopg opens
    (``BEGIN``) the cursor's road is taken.
    """
    text = _PyFormat.TEXT
    result = _send_prepared(raw, form.bound, transformer.dump_sequence(args, [text] * len(args)))
    status = result.status
    if status == _ExecStatus.FATAL_ERROR:
        raise _errors.error_from_result(result, encoding=raw.info.encoding)
    if status != _ExecStatus.TUPLES_OK or not result.ntuples:
        return None
    loader = _Transformer(raw)  # as a cursor loads a result: this connection's loaders now
    loader.set_pgresult(result)
    return loader.load_row(0, tuple)


def _run_prepared(
    raw: Any,
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
    session = _session(raw)
    prepared, used = session.prepared, session.used
    if form is None or session.misses >= MAX_MISSES or form.name not in used:
        # The first use on a connection runs plainly: a connection that serves
        # one message (CONN_MAX_AGE=0, closed after each task) never pays the
        # PREPARE round trip.
        if form is not None:
            used.add(form.name)
        return _run_plainly(raw, sql, args)
    try:
        if form.name not in prepared:
            # A session that has it already has this very text under that name.
            with (
                _DriverCursor(raw) as cursor,
                contextlib.suppress(_errors.DuplicatePreparedStatement),
            ):
                cursor.execute(form.prepare)
            prepared.add(form.name)
        if not in_transaction:
            return _execute_bound(raw, form, args, transformer)
        with _DriverCursor(raw) as cursor:
            cursor.execute(_execute(form, args, transformer))
            return cursor.fetchone()
    except (_errors.InvalidSqlStatementName, _errors.FeatureNotSupported):
        lose(raw, {form.name})
        if in_transaction:
            raise PreparedMissing(form.name) from None
        with contextlib.suppress(_errors.Error), _DriverCursor(raw) as cursor:
            cursor.execute(f"DEALLOCATE {form.name}")
    return _run_plainly(raw, sql, args)


def _run_plainly(raw: Any, sql: str, args: Sequence[Any]) -> Any:
    with _DriverCursor(raw) as cursor:
        cursor.execute(sql, _named(args))
        return cursor.fetchone()


# -- Statements composed into a longer text ------------------------------------------------

#: The names :func:`execute_text` composed (a session that lost one lost them all, likely).
_composed: set[str] = set()


def execute_text(conn: Any, sql: str, args: Sequence[Any]) -> tuple[str | None, str] | None:
    """``sql`` (its arguments named as :func:`fetch_one`'s) as a prepared statement of the
    session under ``conn``, for a caller that sends several statements in one text:
    ``(PREPARE text or None where the session has it already, EXECUTE text with args as
    literals)``; None: send ``sql`` itself (a ``%`` that is no argument, or a connection
    whose prepared statements went missing too often). A ``PREPARE`` sent in a transaction
    that rolls back stays prepared; the caller reports a failed one to :func:`missed`."""
    raw = conn.connection
    form = _prepared_form(sql)
    session = _session(raw)
    prepared = session.prepared
    if form is None or session.misses >= MAX_MISSES:
        return None
    prepare = None if form.name in prepared else form.prepare
    prepared.add(form.name)  # sent with this text; :func:`missed` takes it back
    _composed.add(form.name)
    return prepare, _execute(form, args, _transformer(conn, raw)).decode()


def missed(conn: Any, exc: BaseException) -> bool:
    """Whether ``exc`` (Django's error, the driver's as its cause) says the session lacks
    a statement :func:`execute_text` composed, holds one already (a pooler's other
    session) or holds one with a stale plan; if so it counts as a miss, and all of them
    are prepared again next time (the session lost them all, as ``DISCARD ALL`` does)."""
    cause = exc.__cause__
    if _errors is None or not isinstance(
        cause,
        _errors.InvalidSqlStatementName
        | _errors.DuplicatePreparedStatement
        | _errors.FeatureNotSupported,
    ):
        return False
    raw = conn.connection
    if raw in _sessions:
        lose(raw, set() if isinstance(cause, _errors.DuplicatePreparedStatement) else _composed)
    return True
