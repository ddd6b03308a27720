"""The ``Idempotency-Key`` header: parse, claim, lease, store and replay.

A request carrying a key runs like this:

1. The key is parsed (the quoted sf-string ``"abc"`` or the bare ``abc``) and
   scoped to the principal, method and route; the request is fingerprinted
   over method, route, query and body.
2. The key is *claimed* in its own committed statement (an ``INSERT`` whose
   unique index decides the race, or a conditional ``UPDATE`` of an issued
   token), so concurrent requests see it before the view runs. The view is
   exempted from ``ATOMIC_REQUESTS`` for this and runs in its own
   ``transaction.atomic()`` when the database asks for atomic requests.
3. While the view runs, a shared heartbeat thread renews the claim's lease
   once a third of it has passed (fast views cost no renewal), so a slow view
   is never run twice; a crashed one is taken over once its lease expires. A
   live lease keeps the key from expiring (``KEY_TTL``); a holder that lost its
   lease never stores, and in a transaction rolls its view back.
4. The response is stored (status, allow-listed headers, body bytes) and
   replayed to retries with ``Idempotent-Replayed: true``. A 5xx or an
   exception releases the key so the client may retry. Streaming responses and
   bodies over ``MAX_STORED_RESPONSE_BYTES`` are stored without their body.

:mod:`idempotent_orders.http.decorators` runs these steps around a view
(``@idempotent_view``, sync or async), so this module imports no other module
of ``http/``. Import these names from :mod:`idempotent_orders.http.keys`, their
public path, which re-exports them next to the deprecated decorator aliases.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    IntegrityError,
    connection,
    connections,
    models,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.functions import Greatest
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.utils import timezone
from django.utils.module_loading import import_string

from idempotent_orders.conf import conf
from idempotent_orders.consuming.sql import build, compiled_read, driver_cursor, fetch_one
from idempotent_orders.exceptions import (
    BodyTooLarge,
    KeyInFlight,
    KeyInvalid,
    KeyMismatch,
    QuotaExceeded,
    TokenInvalid,
    TooManySessions,
)
from idempotent_orders.models import IdempotencyKey, KeyQuota, KeyState

try:
    from psycopg import Error as _DriverError
except ImportError:  # psycopg2, or no PostgreSQL driver
    _DriverError = None  # type: ignore[assignment,misc]

__all__ = [
    "HEADER",
    "TOKEN_PREFIX",
    "default_principal",
    "get_principal",
    "parse_key",
    "purge_expired",
    "stored_principal",
]

logger = logging.getLogger("idempotent_orders")

HEADER = "Idempotency-Key"
#: Server-issued tokens start with this; client keys must not.
TOKEN_PREFIX = "iot_"
#: Methods an idempotency key applies to; safe methods pass straight through.
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def parse_key(raw: str) -> str:
    """The key of an ``Idempotency-Key`` header value; raise :class:`KeyInvalid`.

    Accepts an RFC 8941 sf-string (``"abc"``, with ``\\"`` and ``\\\\`` escapes)
    and, as many clients send it, the bare key. Keys are printable ASCII,
    non-empty and at most ``KEY_MAX_LENGTH`` characters.
    """
    value = raw.strip(" \t")
    if len(value) >= 2 and value[0] == '"':
        if value[-1] != '"':
            raise KeyInvalid("unterminated quoted Idempotency-Key")
        chars: list[str] = []
        escaped = False
        for char in value[1:-1]:
            if escaped:
                if char not in '"\\':
                    raise KeyInvalid("invalid escape in quoted Idempotency-Key")
                chars.append(char)
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                raise KeyInvalid("unescaped quote inside Idempotency-Key")
            else:
                chars.append(char)
        if escaped:
            raise KeyInvalid("dangling escape in quoted Idempotency-Key")
        key = "".join(chars)
    else:
        key = value
        if any(c in key for c in ' "\\'):
            raise KeyInvalid("a bare Idempotency-Key must not contain spaces, quotes or '\\'")
    if not key:
        raise KeyInvalid("Idempotency-Key is empty")
    if not (key.isascii() and key.isprintable()):  # " " to "~"
        raise KeyInvalid("Idempotency-Key must be printable ASCII")
    limit = min(conf.KEY_MAX_LENGTH, 255)
    if len(key) > limit:
        raise KeyInvalid(f"Idempotency-Key is {len(key)} characters, the limit is {limit}")
    return key


def default_principal(request: HttpRequest) -> str | None:
    """``user:<pk>``, ``client:<id>`` (set by an API-client auth layer) or ``session:<key>``.

    An anonymous caller's principal is its session. A page load (a safe method:
    the template tag minting a form's token) creates one if needed, at most
    ``SESSION_RATE`` per client IP per ``SESSION_RATE_WINDOW`` seconds (then
    :class:`TooManySessions`, 429). An unsafe request without a session gets
    none (a new session per request would make every retry a new principal,
    its key protecting nothing): it has no principal, and its key answers 401
    ``session-required``. Without the session middleware there is no principal.
    """
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    client = getattr(request, "idempotency_client", None)
    if client:
        return f"client:{client}"
    session = getattr(request, "session", None)
    if session is None:
        return None
    if not session.session_key:
        if request.method in UNSAFE_METHODS:
            return None
        _count_new_session(request)
        session.save()
        session.modified = True  # so the middleware sends the new session's cookie
    return f"session:{session.session_key}"


def _count_new_session(request: HttpRequest) -> None:
    """Count a new anonymous session against its client IP; raise past ``SESSION_RATE``.

    The count lives in the ``LOCK_CACHE`` cache, one fixed window per address
    (``REMOTE_ADDR``: behind a proxy, set it from the proxy's header first).
    """
    from django.core.cache import caches

    window = conf.SESSION_RATE_WINDOW
    address = request.META.get("REMOTE_ADDR") or "unknown"
    slot = int(time.time()) // window
    name = f"idempotent_orders:sessions:{hashlib.sha256(address.encode()).hexdigest()[:32]}:{slot}"
    cache = caches[conf.LOCK_CACHE]
    cache.add(name, 0, timeout=window + 1)
    try:
        count = cache.incr(name)
    except ValueError:  # expired between add and incr
        cache.add(name, 1, timeout=window + 1)
        count = 1
    if count > conf.SESSION_RATE:
        retry_after = max(1, (slot + 1) * window - int(time.time()))
        raise TooManySessions(
            f"{address} started more than {conf.SESSION_RATE} sessions in {window} seconds;"
            " send back the session cookie you were given, or wait",
            retry_after=retry_after,
        )


@functools.lru_cache(maxsize=8)
def _resolver(path: str) -> Any:
    return import_string(path)


def get_principal(request: HttpRequest) -> str | None:
    """The principal of ``request`` through the ``PRINCIPAL_RESOLVER`` setting."""
    cached = getattr(request, "_idempotency_principal", None)
    if cached is not None:
        return str(cached)
    principal = _resolver(conf.PRINCIPAL_RESOLVER)(request)
    if principal is not None:
        principal = str(principal)  # whole: see stored_principal for its column
        request._idempotency_principal = principal  # type: ignore[attr-defined]
    return principal


#: The longest principal stored as it is (the ``principal`` columns hold 191 characters).
_PRINCIPAL_KEPT = 190


def stored_principal(principal: str) -> str:
    """``principal`` as its keys, tokens and quota bound store it (at most 191 characters).

    A principal of up to 190 characters is stored as it is; a longer one as its
    first 126 characters (to read), ``#`` and the SHA-256 of the whole, exactly
    191 characters, so no two principals share a stored value: two API clients
    whose ids differ past any prefix get neither each other's keys, nor tokens,
    nor quota.
    """
    if len(principal) <= _PRINCIPAL_KEPT:
        return principal
    digest = hashlib.sha256(principal.encode()).hexdigest()
    return f"{principal[: _PRINCIPAL_KEPT - len(digest)]}#{digest}"


def scope_of(principal: str, method: str, route: str) -> str:
    """The scope of a key: a SHA-256 over the whole ``principal``, ``method`` and ``route``."""
    return hashlib.sha256(f"{principal}\n{method}\n{route}".encode()).hexdigest()


def check_length(request: HttpRequest) -> None:
    limit = conf.MAX_REQUEST_BYTES
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    if declared > limit:
        raise BodyTooLarge(f"request body is {declared} bytes, the limit is {limit}")


def read_body(request: HttpRequest) -> bytes:
    """The request body within ``MAX_REQUEST_BYTES``; raise :class:`BodyTooLarge`."""
    limit = conf.MAX_REQUEST_BYTES
    check_length(request)
    body = request.body
    if len(body) > limit:
        raise BodyTooLarge(f"request body is {len(body)} bytes, the limit is {limit}")
    return body


def fingerprint(request: HttpRequest, body: bytes) -> str:
    digest = hashlib.sha256()
    for part in (request.method or "", request.path, request.META.get("QUERY_STRING", "")):
        digest.update(part.encode("utf-8", "surrogateescape") + b"\n")
    digest.update(body)
    return digest.hexdigest()


@dataclass
class Claim:
    """A key this request holds: it runs the view and stores the response."""

    row: IdempotencyKey
    owner: str


def claim(
    *,
    principal: str,
    key: str,
    method: str,
    route: str,
    fingerprint: str,
    is_form: bool = False,
) -> Claim | IdempotencyKey:
    """Claim ``key`` for this request, or return the completed row to replay.

    Each statement commits on its own (callers run outside any transaction):
    the claim must be visible to concurrent requests while the view runs.
    """
    now = timezone.now()
    owner = secrets.token_hex(16)
    scope = scope_of(principal, method, route)  # the whole principal
    holder = stored_principal(principal)
    lease = now + timedelta(seconds=conf.KEY_LEASE)
    if key.startswith(TOKEN_PREFIX):
        taken = IdempotencyKey.objects.filter(
            principal=holder,
            key=key,
            is_token=True,
            state=KeyState.ISSUED,
            expires_at__gt=now,
        ).update(
            state=KeyState.IN_FLIGHT,
            scope=scope,
            method=method,
            route=route[:255],
            fingerprint=fingerprint,
            lease_owner=owner,
            lease_expires_at=lease,
            expires_at=now + timedelta(seconds=conf.KEY_TTL),
        )
        if taken:
            return Claim(IdempotencyKey.objects.get(scope=scope, key=key), owner)
        row = IdempotencyKey.objects.filter(_alive(now), scope=scope, key=key).first()
        if row is None:
            raise TokenInvalid(
                "this token was not issued to you, has expired, or was used on another route"
            )
        return _decide(row, fingerprint, owner)
    if is_form:
        raise TokenInvalid("forms need a token rendered by {% idempotency_token %}")
    fields = {
        "scope": scope,
        "key": key,
        "principal": holder,
        "method": method,
        "route": route[:255],
        "fingerprint": fingerprint,
        "state": KeyState.IN_FLIGHT,
        "lease_owner": owner,
        "lease_expires_at": lease,
        "expires_at": now + timedelta(seconds=conf.KEY_TTL),
    }
    for _attempt in range(5):
        found = _insert_within_quota(fields, now)
        if isinstance(found, int):
            return Claim(IdempotencyKey(pk=found, **fields), owner)
        row = found or IdempotencyKey.objects.filter(scope=scope, key=key).first()
        if row is not None and row.expires_at <= now and not _lease_live(row, now):
            # An expired key is forgotten, as if purged; the purge command does it in
            # bulk. Never a claim whose lease is live: its view is still running.
            IdempotencyKey.objects.filter(pk=row.pk).exclude(_alive(now)).delete()
            continue
        if row is not None:
            return _decide(row, fingerprint, owner)
        live = _live_keys(holder, now)
        if live >= conf.KEY_QUOTA:
            raise QuotaExceeded(
                f"you hold {live} live idempotency keys, the limit is {conf.KEY_QUOTA}",
                retry_after=conf.RETRY_AFTER,
            )
        # The key was released or purged between the insert and the look-up: again.
    raise KeyInFlight("the key is contended; retry", retry_after=conf.RETRY_AFTER)


def _live_keys(principal: str, now: Any) -> int:
    return IdempotencyKey.objects.filter(principal=principal, expires_at__gt=now).count()


def _alive(now: Any) -> models.Q:
    """Rows not yet expired: before ``expires_at``, or in flight with a live lease."""
    return models.Q(expires_at__gt=now) | models.Q(
        state=KeyState.IN_FLIGHT, lease_expires_at__gt=now
    )


def _lease_live(row: IdempotencyKey, now: Any) -> bool:
    return (
        row.state == KeyState.IN_FLIGHT
        and row.lease_expires_at is not None
        and row.lease_expires_at > now
    )


def _lease_values(lease: Any) -> dict[str, Any]:
    """A lease ending at ``lease`` and an expiry no earlier: ``KEY_TTL`` never ends a live lease."""
    return {
        "lease_expires_at": lease,
        "expires_at": Greatest(
            "expires_at", models.Value(lease, output_field=models.DateTimeField())
        ),
    }


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


def _one_round_trip(conn: BaseDatabaseWrapper) -> bool:
    """Whether the claim can go as one multi-statement query: psycopg 3 with
    client-side binding (Django's default) and no transaction open around it."""
    if conn.in_atomic_block or conn.settings_dict["OPTIONS"].get("server_side_binding"):
        return False
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    return bool(is_psycopg3)


def _lock_id(principal: str) -> int:
    """A signed 64-bit advisory lock id for ``principal`` (PostgreSQL)."""
    digest = hashlib.sha256(b"idempotent_orders.quota\n" + principal.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


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
    vendor = conn.vendor
    qn = conn.ops.quote_name
    table = qn(IdempotencyKey._meta.db_table)
    columns = ", ".join(qn(c) for c in _CLAIM_COLUMNS)
    values = ", ".join(["%s"] * len(_CLAIM_COLUMNS))
    json_empty = "'[]'::jsonb" if vendor == "postgresql" else "'[]'"
    extra_cols = f"{qn('is_token')}, {qn('body_omitted')}, {qn('response_headers')}"
    extra_vals = f"FALSE, FALSE, {json_empty}"
    count = f"SELECT COUNT(*) FROM {table} WHERE {qn('principal')} = %s AND {qn('expires_at')} > %s"
    absent = f"NOT EXISTS (SELECT 1 FROM {table} WHERE {qn('scope')} = %s AND {qn('key')} = %s)"
    if vendor == "postgresql":
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
        guard = f"({count}) < %s"
        if vendor == "mysql":
            sql = (
                f"INSERT IGNORE INTO {table} ({columns}, {extra_cols}) "
                f"SELECT {values}, {extra_vals} FROM DUAL WHERE {guard} RETURNING {qn('id')}"
            )
        else:
            sql = (
                f"INSERT INTO {table} ({columns}, {extra_cols}) "
                f"SELECT {values}, {extra_vals} WHERE {guard} "
                f"ON CONFLICT ({qn('scope')}, {qn('key')}) DO NOTHING RETURNING {qn('id')}"
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


def _insert_within_quota(fields: dict[str, Any], now: Any) -> int | IdempotencyKey | None:
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
    vendor = conn.vendor
    if vendor not in {"postgresql", "mysql", "sqlite"} or (
        vendor == "mysql" and not getattr(conn, "mysql_is_mariadb", False)
    ):
        return _insert_portable(fields, now)
    texts = _claim_texts(conn)
    values = _claim_params(conn, fields, now)
    if vendor == "postgresql":
        values["lock"] = _lock_id(fields["principal"])
        if _one_round_trip(conn):
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
    elif vendor == "mysql":
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


#: What the claim's prepared statements (PostgreSQL) are named after, in the order they run.
_CLAIM_STATEMENTS = (
    "idempotent_orders_claim_read",
    "idempotent_orders_claim_lock",
    "idempotent_orders_claim_insert",
)
#: Raw connections whose session holds the claim's prepared statements.
_prepared_on: weakref.WeakSet[Any] = weakref.WeakSet()
#: Per raw connection: how many times its session turned out not to hold them.
_misses: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
#: Misses after which a connection sends the claim as text for good (a transaction
#: pooler such as PgBouncer's changes the server session under its clients).
_MAX_MISSES = 3
#: Raw connections that reached ``_MAX_MISSES``.
_shared_sessions: weakref.WeakSet[Any] = weakref.WeakSet()


@dataclass(frozen=True)
class _PreparedClaim:
    """The claim's statements prepared on a connection, and the query that runs them."""

    #: ``PREPARE`` of each statement, named after its role and a hash of its text (so a
    #: name stands for one text only, across versions of the app sharing a server session).
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
    for role, statement in zip(_CLAIM_STATEMENTS, statements, strict=True):
        distinct = tuple(dict.fromkeys(statement.names))
        parts = statement.sql.split("%s")
        assert len(parts) == len(statement.names) + 1, "one placeholder per name"
        numbered = parts[0] + "".join(
            f"${distinct.index(n) + 1}{part}"
            for n, part in zip(statement.names, parts[1:], strict=True)
        )
        body = f"({', '.join(_param_type(conn, n) for n in distinct)}) AS {numbered}"
        name = f"{role}_{hashlib.blake2b(body.encode(), digest_size=5).hexdigest()}"
        prepares.append(f"PREPARE {name} {body}")
        names.append(name)
        executes.append(f"EXECUTE {name} ({', '.join(['%s'] * len(distinct))})")
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
    (see :func:`~idempotent_orders.consuming.sql.driver_cursor`).
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
    up to :data:`_MAX_MISSES` misses: the connection then sends text for good.
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
        or raw in _shared_sessions
    ):
        cursor.execute(*_joined(statements, values))
        return
    prepared = _prepared_claim(conn, statements)
    params = [values[name] for name in prepared.order]
    if raw not in _prepared_on:
        try:
            cursor.execute(prepared.prepare_and_execute, params)
            _prepared_on.add(raw)
            for _ in prepared.prepares:
                cursor.nextset()  # to the first EXECUTE's rows
            return
        except _DB_ERRORS as exc:
            if _sqlstate(exc) != "42P05":  # already prepared in this server session
                raise
            _prepared_on.add(raw)
    try:
        cursor.execute(prepared.execute, params)
    except _DB_ERRORS as exc:
        if _sqlstate(exc) != "26000":  # no such prepared statement
            raise
        _prepared_on.discard(raw)
        _misses[raw] = _misses.get(raw, 0) + 1
        if _misses[raw] >= _MAX_MISSES:
            _shared_sessions.add(raw)
        cursor.execute(*_joined(statements, values))


#: What a failed statement raises: Django's error, or the driver's own on its cursor.
_DB_ERRORS: tuple[type[Exception], ...] = (
    (DatabaseError,) if _DriverError is None else (DatabaseError, _DriverError)
)


def _sqlstate(exc: BaseException) -> str | None:
    return getattr(exc, "sqlstate", None) or getattr(exc.__cause__, "sqlstate", None)


def _insert_portable(fields: dict[str, Any], now: Any) -> int | None:
    """Count, then insert: the quota may be exceeded by claims made at the same instant."""
    if _live_keys(fields["principal"], now) >= conf.KEY_QUOTA:
        return None
    try:
        with transaction.atomic():
            return int(IdempotencyKey.objects.create(**fields).pk)
    except IntegrityError:
        return None


def _decide(row: IdempotencyKey, fingerprint: str, owner: str) -> Claim | IdempotencyKey:
    if row.fingerprint != fingerprint:
        raise KeyMismatch("this key was first used with a different request (method, path or body)")
    if row.state == KeyState.COMPLETED:
        return row
    now = timezone.now()
    if row.lease_expires_at is not None and row.lease_expires_at <= now:
        # The holder stopped heart-beating (it crashed): take the key over.
        taken = IdempotencyKey.objects.filter(
            pk=row.pk, state=KeyState.IN_FLIGHT, lease_owner=row.lease_owner
        ).update(lease_owner=owner, **_lease_values(now + timedelta(seconds=conf.KEY_LEASE)))
        if taken:
            row.lease_owner = owner
            return Claim(row, owner)
    raise KeyInFlight(
        "a request with this key is still being processed", retry_after=conf.RETRY_AFTER
    )


def release(held: Claim) -> None:
    """Give the key back (5xx, exception, invalid form): the client may retry with it."""
    row = held.row
    mine = IdempotencyKey.objects.filter(pk=row.pk, lease_owner=held.owner)
    if row.is_token:
        mine.update(
            state=KeyState.ISSUED,
            scope=scope_of(row.principal, "", ""),
            method="",
            route="",
            fingerprint="",
            lease_owner="",
            lease_expires_at=None,
            expires_at=timezone.now() + timedelta(seconds=conf.TOKEN_TTL),
        )
    else:
        mine.delete()


#: Columns the stored response sets, in the order of its UPDATE's assignments.
_STORE_COLUMNS = (
    "state",
    "response_status",
    "response_headers",
    "response_body",
    "body_omitted",
    "completed_at",
    "lease_owner",
    "lease_expires_at",
)
#: The stored response's UPDATE, by database alias.
_store_sql: dict[str, str] = {}
#: The lower-cased ``REPLAY_HEADERS``, and the setting's value they were made from.
_replay_headers: tuple[list[str], frozenset[str]] = ([], frozenset())


def _kept_headers(response: HttpResponseBase) -> list[list[str]]:
    """The response's headers that ``REPLAY_HEADERS`` allows to be replayed."""
    global _replay_headers
    setting = conf.REPLAY_HEADERS
    if _replay_headers[0] != setting:
        _replay_headers = (setting, frozenset(h.lower() for h in setting))
    allowed = _replay_headers[1]
    return [[k, v] for k, v in response.items() if k.lower() in allowed]


def store(held: Claim, response: HttpResponseBase) -> bool:
    """Store ``response`` under the key; False when the lease was lost to a takeover."""
    conn = connections[DEFAULT_DB_ALIAS]
    body: bytes | None = None
    omitted = True
    if not response.streaming and isinstance(response, HttpResponse):
        content = response.content
        if len(content) <= conf.MAX_STORED_RESPONSE_BYTES:
            body, omitted = content, False
    # One UPDATE in SQL of our own: the ORM's query building costs as much as
    # the round trip on this hot path. Fenced by the lease owner and state.
    sql = _store_sql.get(conn.alias)
    if sql is None:
        qn = conn.ops.quote_name
        assignments = ", ".join(f"{qn(name)} = %(a{n})s" for n, name in enumerate(_STORE_COLUMNS))
        n = len(_STORE_COLUMNS)
        sql = (
            f"UPDATE {qn(IdempotencyKey._meta.db_table)} SET {assignments} WHERE {qn('id')}"
            f" = %(a{n})s AND {qn('lease_owner')} = %(a{n + 1})s AND {qn('state')} = %(a{n + 2})s"
        )
        if conn.vendor == "postgresql":
            sql += f" RETURNING {qn('id')}"
        _store_sql[conn.alias] = sql
    args = [
        KeyState.COMPLETED,
        response.status_code,
        _field("response_headers").get_db_prep_save(_kept_headers(response), conn),
        _field("response_body").get_db_prep_save(body, conn),
        omitted,
        conn.ops.adapt_datetimefield_value(timezone.now()),
        "",
        None,
        held.row.pk,
        held.owner,
        KeyState.IN_FLIGHT,
    ]
    if conn.vendor == "postgresql":
        # A prepared statement of the session from its second use on.
        stored = fetch_one(sql, args, conn) is not None
    else:
        with conn.cursor() as cursor:
            cursor.execute(sql, {f"a{n}": value for n, value in enumerate(args)})
            stored = bool(cursor.rowcount)
    if not stored:
        logger.warning(
            "idempotency key %s lost its lease before the response was stored", held.row.pk
        )
    return stored


def replay(row: IdempotencyKey) -> HttpResponse:
    """The stored response, marked ``Idempotent-Replayed: true``."""
    body = bytes(row.response_body) if row.response_body is not None else b""
    response = HttpResponse(body, status=row.response_status or 200)
    for name, value in row.response_headers or []:
        if row.body_omitted and name.lower() in {"content-type", "content-length"}:
            continue
        response[name] = value
    if row.body_omitted:
        # The original body was streamed or too large to keep: say so, send none.
        response["Idempotent-Body-Omitted"] = "true"
        del response["Content-Type"]
    response["Idempotent-Replayed"] = "true"
    return response


class _Beater:
    """One shared thread renewing the leases of claims whose view runs long.

    A claim is registered when its view starts and renewed only once a third
    of the lease has passed, so a fast request costs no thread and no query;
    the thread (with its own connection) is started on first use and idles
    on a condition while nothing is due.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.due: dict[int, tuple[Claim, float]] = {}
        self.thread: threading.Thread | None = None
        self.next_id = 0
        #: When the thread wakes up next on its own (monotonic; inf: when notified).
        self.wake_at = float("inf")

    def add(self, held: Claim) -> int:
        with self.cond:
            self.next_id += 1
            ident = self.next_id
            at = time.monotonic() + _beat_interval()
            self.due[ident] = (held, at)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="idempotency-heartbeat", daemon=True
                )
                self.thread.start()
            elif at < self.wake_at:
                # Only then: waking the thread for every request would cost each
                # one a thread switch (an idle thread wakes once per interval).
                self.cond.notify()
        return ident

    def remove(self, ident: int) -> None:
        with self.cond:
            self.due.pop(ident, None)

    def _run(self) -> None:
        while True:
            with self.cond:
                while True:
                    now = time.monotonic()
                    ready = [(i, h) for i, (h, at) in self.due.items() if at <= now]
                    if ready:
                        break
                    upcoming = [at for _h, at in self.due.values()]
                    if not upcoming:
                        connection.close()  # this thread's own; reopened when a beat is due
                    # Idle, it still wakes once per interval: a claim added meanwhile is
                    # due no earlier than that, so adding one need not wake it.
                    self.wake_at = min(upcoming) if upcoming else now + _beat_interval()
                    self.cond.wait(self.wake_at - now)
                for ident, held in ready:
                    self.due[ident] = (held, now + _beat_interval())
            for _ident, held in ready:
                try:
                    renew(held)
                except Exception:  # a missed beat only risks a takeover, never corruption
                    logger.warning("idempotency heartbeat failed", exc_info=True)


def renew(held: Claim) -> None:
    """One heartbeat: extend ``held``'s lease (and its expiry with it), if it still holds it."""
    lease = timezone.now() + timedelta(seconds=conf.KEY_LEASE)
    IdempotencyKey.objects.filter(pk=held.row.pk, lease_owner=held.owner).update(
        **_lease_values(lease)
    )


def _beat_interval() -> float:
    return max(conf.KEY_LEASE / 3, 0.05)


_beater = _Beater()


@contextmanager
def heartbeat(held: Claim) -> Iterator[None]:
    """Keep ``held``'s lease alive while the block runs (renewed from a third of the lease on)."""
    ident = _beater.add(held)
    try:
        yield
    finally:
        _beater.remove(ident)


_HEADER_META = "HTTP_" + HEADER.upper().replace("-", "_")


def header_key(request: HttpRequest) -> str | None:
    """The key of the request's ``Idempotency-Key`` header, or None without one."""
    raw = request.META.get(_HEADER_META)  # request.headers would parse every header
    if raw is None:
        return None
    return parse_key(raw)


def purge_expired(*, now: Any = None) -> int:
    """Delete expired keys and tokens (not a claim whose lease is still live)."""
    now = now or timezone.now()
    deleted, _ = (
        IdempotencyKey.objects.filter(expires_at__lte=now)
        .exclude(state=KeyState.IN_FLIGHT, lease_expires_at__gt=now)
        .delete()
    )
    forget_stale_bounds(now=now)
    return deleted


def forget_stale_bounds(*, now: Any = None) -> int:
    """Delete the quota bounds no claim has raised for ``KEY_TTL`` (their keys have expired).

    Always safe: a principal without a bound has its live keys counted at its
    next claim, which sets a new bound.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=conf.KEY_TTL)
    deleted, _ = KeyQuota.objects.filter(updated_at__lt=cutoff).delete()
    return deleted


def raise_bound(conn: BaseDatabaseWrapper, principal: str) -> None:
    """Count one more live key for ``principal`` (as stored: :func:`stored_principal`)
    in its quota bound, if it has one (PostgreSQL).

    For keys inserted outside a claim (tokens), in their inserting transaction,
    which must hold the principal's claim lock (:func:`lock_principal`).
    """
    if conn.vendor == "postgresql":
        qn = conn.ops.quote_name
        with conn.cursor() as cursor:
            cursor.execute(
                f"UPDATE {qn(KeyQuota._meta.db_table)} SET {qn('bound')} = {qn('bound')} + 1,"
                f" {qn('updated_at')} = now() WHERE {qn('principal')} = %s",
                [principal],
            )


def lock_principal(conn: BaseDatabaseWrapper, principal: str) -> None:
    """Serialize with ``principal``'s claims until the transaction ends (PostgreSQL);
    ``principal`` as stored (:func:`stored_principal`)."""
    if conn.vendor == "postgresql":
        with conn.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_lock_id(principal)])
