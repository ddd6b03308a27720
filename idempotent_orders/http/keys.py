"""The ``Idempotency-Key`` header: claim, lease, store and replay, as a decorator and a mixin.

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
   is never run twice; a crashed one is taken over once its lease expires.
4. The response is stored (status, allow-listed headers, body bytes) and
   replayed to retries with ``Idempotent-Replayed: true``. A 5xx or an
   exception releases the key so the client may retry. Streaming responses and
   bodies over ``MAX_STORED_RESPONSE_BYTES`` are stored without their body.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from django.db import IntegrityError, connection, connections, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.utils import timezone
from django.utils.module_loading import import_string

from idempotent_orders.conf import conf
from idempotent_orders.exceptions import (
    BodyTooLarge,
    IdempotencyError,
    KeyInFlight,
    KeyInvalid,
    KeyMismatch,
    KeyMissing,
    NotAuthenticated,
    QuotaExceeded,
    TokenInvalid,
)
from idempotent_orders.http.problems import problem_from
from idempotent_orders.models import IdempotencyKey, KeyState
from idempotent_orders.signals import idempotent_request

__all__ = [
    "HEADER",
    "TOKEN_PREFIX",
    "IdempotentMixin",
    "default_principal",
    "get_principal",
    "idempotent",
    "parse_key",
    "purge_expired",
]

logger = logging.getLogger("idempotent_orders")

HEADER = "Idempotency-Key"
#: Server-issued tokens start with this; client keys must not.
TOKEN_PREFIX = "iot_"
#: Methods an idempotency key applies to; safe methods pass straight through.
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})

View = Callable[..., HttpResponseBase]
V = TypeVar("V", bound=View)


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
    if not all(" " <= c <= "~" for c in key):
        raise KeyInvalid("Idempotency-Key must be printable ASCII")
    limit = min(conf.KEY_MAX_LENGTH, 255)
    if len(key) > limit:
        raise KeyInvalid(f"Idempotency-Key is {len(key)} characters, the limit is {limit}")
    return key


def default_principal(request: HttpRequest) -> str | None:
    """``user:<pk>``, ``client:<id>`` (set by an API-client auth layer) or ``session:<key>``.

    Anonymous callers get a session (one is created if needed); without the
    session middleware they have no principal and keys answer 401.
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
        session.save()
        session.modified = True  # so the middleware sends the new session's cookie
    return f"session:{session.session_key}"


def get_principal(request: HttpRequest) -> str | None:
    """The principal of ``request`` through the ``PRINCIPAL_RESOLVER`` setting."""
    cached = getattr(request, "_idempotency_principal", None)
    if cached is not None:
        return str(cached)
    principal = import_string(conf.PRINCIPAL_RESOLVER)(request)
    if principal is not None:
        principal = str(principal)[:191]
        request._idempotency_principal = principal  # type: ignore[attr-defined]
    return principal


def scope_of(principal: str, method: str, route: str) -> str:
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
    scope = scope_of(principal, method, route)
    lease = now + timedelta(seconds=conf.KEY_LEASE)
    if key.startswith(TOKEN_PREFIX):
        taken = IdempotencyKey.objects.filter(
            principal=principal,
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
        row = IdempotencyKey.objects.filter(scope=scope, key=key, expires_at__gt=now).first()
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
        "principal": principal,
        "method": method,
        "route": route[:255],
        "fingerprint": fingerprint,
        "state": KeyState.IN_FLIGHT,
        "lease_owner": owner,
        "lease_expires_at": lease,
        "expires_at": now + timedelta(seconds=conf.KEY_TTL),
    }
    for _attempt in range(5):
        pk = _insert_within_quota(fields, now)
        if pk is not None:
            return Claim(IdempotencyKey(pk=pk, **fields), owner)
        row = IdempotencyKey.objects.filter(scope=scope, key=key).first()
        if row is not None and row.expires_at <= now:
            # An expired key is forgotten, as if purged; the purge command does it in bulk.
            IdempotencyKey.objects.filter(pk=row.pk, expires_at__lte=now).delete()
            continue
        if row is not None:
            return _decide(row, fingerprint, owner)
        live = _live_keys(principal, now)
        if live >= conf.KEY_QUOTA:
            raise QuotaExceeded(
                f"you hold {live} live idempotency keys, the limit is {conf.KEY_QUOTA}",
                retry_after=conf.RETRY_AFTER,
            )
        # The key was released or purged between the insert and the look-up: again.
    raise KeyInFlight("the key is contended; retry", retry_after=conf.RETRY_AFTER)


def _live_keys(principal: str, now: Any) -> int:
    return IdempotencyKey.objects.filter(principal=principal, expires_at__gt=now).count()


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


def _one_round_trip() -> bool:
    """Whether the claim can go as one multi-statement query: psycopg 3 with
    client-side binding (Django's default) and no transaction open around it."""
    if connection.in_atomic_block or connection.settings_dict["OPTIONS"].get("server_side_binding"):
        return False
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    return bool(is_psycopg3)


def _lock_id(principal: str) -> int:
    """A signed 64-bit advisory lock id for ``principal`` (PostgreSQL)."""
    digest = hashlib.sha256(b"idempotent_orders.quota\n" + principal.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _insert_within_quota(fields: dict[str, Any], now: Any) -> int | None:
    """Insert the claim if the key is new and the principal is under quota: its pk, else None.

    One ``INSERT ... SELECT ... WHERE <live keys> < quota ON CONFLICT DO NOTHING
    RETURNING`` in its own committed transaction. The quota is exact under
    concurrency because a principal's claims are serialized around it: by a
    transaction-scoped advisory lock on PostgreSQL (the INSERT's snapshot is
    taken after the lock, so it counts every claim committed before), by a
    named lock (``GET_LOCK``) around the autocommitted statement on MariaDB and
    MySQL, and by SQLite's single writer. Other databases take the portable path.
    """
    vendor = connection.vendor
    if vendor not in {"postgresql", "mysql", "sqlite"} or (
        vendor == "mysql" and not getattr(connection, "mysql_is_mariadb", False)
    ):
        return _insert_portable(fields, now)
    qn = connection.ops.quote_name
    meta = IdempotencyKey._meta
    table = qn(meta.db_table)
    prep = [_field(c).get_db_prep_save(fields[c], connection) for c in _CLAIM_COLUMNS]
    principal_col, expires_col = qn("principal"), qn("expires_at")
    now_param = _field("expires_at").get_db_prep_save(now, connection)
    columns = ", ".join(qn(c) for c in _CLAIM_COLUMNS)
    values = ", ".join(["%s"] * len(_CLAIM_COLUMNS))
    json_empty = "'[]'::jsonb" if vendor == "postgresql" else "'[]'"
    extra_cols = f"{qn('is_token')}, {qn('body_omitted')}, {qn('response_headers')}"
    extra_vals = f"FALSE, FALSE, {json_empty}"
    guard = f"(SELECT COUNT(*) FROM {table} WHERE {principal_col} = %s AND {expires_col} > %s) < %s"
    params = [*prep, fields["principal"], now_param, conf.KEY_QUOTA]
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
    if vendor == "postgresql":
        lock_params = [_lock_id(fields["principal"])]
        if _one_round_trip():
            # Both statements in one simple query: PostgreSQL runs them as one
            # implicit transaction (the lock is held until its end, the INSERT
            # takes a fresh snapshot after it), and rolls it back on an error.
            # That transaction's commit need not wait for its WAL flush: any
            # later synchronous commit (the view's writes, the stored response)
            # flushes it first, so a crash loses the claim only together with
            # everything the view did in the database; other requests see it
            # at once either way. One fsync less per request.
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_advisory_xact_lock(%s),"
                    f" set_config('synchronous_commit', 'off', true); {sql}",
                    lock_params + params,
                )
                cursor.nextset()
                found = cursor.fetchone()
        else:
            # Inside a caller's transaction: a savepoint, the lock held until
            # that transaction ends, and its durability left as it is.
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", lock_params)
                cursor.execute(sql, params)
                found = cursor.fetchone()
    elif vendor == "mysql":
        name = "io_quota_" + hashlib.sha256(fields["principal"].encode()).hexdigest()[:48]
        with connection.cursor() as cursor:
            cursor.execute("SELECT GET_LOCK(%s, %s)", [name, conf.KEY_LEASE])
            if cursor.fetchone()[0] != 1:
                raise KeyInFlight("too many concurrent claims; retry", retry_after=conf.RETRY_AFTER)
            try:
                cursor.execute(sql, params)
                found = cursor.fetchone()
            finally:
                cursor.execute("SELECT RELEASE_LOCK(%s)", [name])
                cursor.fetchall()
    else:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql, params)
            found = cursor.fetchone()
    return int(found[0]) if found else None


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
        ).update(lease_owner=owner, lease_expires_at=now + timedelta(seconds=conf.KEY_LEASE))
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


def store(held: Claim, response: HttpResponseBase) -> bool:
    """Store ``response`` under the key; False when the lease was lost to a takeover."""
    allowed = {h.lower() for h in conf.REPLAY_HEADERS}
    headers = [[k, v] for k, v in response.items() if k.lower() in allowed]
    body: bytes | None = None
    omitted = True
    if not response.streaming and isinstance(response, HttpResponse):
        content = response.content
        if len(content) <= conf.MAX_STORED_RESPONSE_BYTES:
            body, omitted = content, False
    values = {
        "state": KeyState.COMPLETED,
        "response_status": response.status_code,
        "response_headers": headers,
        "response_body": body,
        "body_omitted": omitted,
        "completed_at": timezone.now(),
        "lease_owner": "",
        "lease_expires_at": None,
    }
    # One UPDATE in SQL of our own: the ORM's query building costs as much as
    # the round trip on this hot path. Fenced by the lease owner and state.
    qn = connection.ops.quote_name
    assignments = ", ".join(f"{qn(name)} = %s" for name in values)
    params = [_field(name).get_db_prep_save(v, connection) for name, v in values.items()]
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {qn(IdempotencyKey._meta.db_table)} SET {assignments} "
            f"WHERE {qn('id')} = %s AND {qn('lease_owner')} = %s AND {qn('state')} = %s",
            [*params, held.row.pk, held.owner, KeyState.IN_FLIGHT],
        )
        stored = cursor.rowcount
    if not stored:
        logger.warning(
            "idempotency key %s lost its lease before the response was stored", held.row.pk
        )
    return bool(stored)


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

    def add(self, held: Claim) -> int:
        with self.cond:
            self.next_id += 1
            ident = self.next_id
            self.due[ident] = (held, time.monotonic() + _beat_interval())
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="idempotency-heartbeat", daemon=True
                )
                self.thread.start()
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
                    self.cond.wait(min(upcoming) - now if upcoming else None)
                for ident, held in ready:
                    self.due[ident] = (held, now + _beat_interval())
            for _ident, held in ready:
                try:
                    IdempotencyKey.objects.filter(pk=held.row.pk, lease_owner=held.owner).update(
                        lease_expires_at=timezone.now() + timedelta(seconds=conf.KEY_LEASE)
                    )
                except Exception:  # a missed beat only risks a takeover, never corruption
                    logger.warning("idempotency heartbeat failed", exc_info=True)


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


def _atomic_requests() -> ExitStack:
    """``transaction.atomic()`` for each database with ``ATOMIC_REQUESTS``, as Django would."""
    stack = ExitStack()
    for db in connections.all(initialized_only=False):
        if db.settings_dict.get("ATOMIC_REQUESTS"):
            stack.enter_context(transaction.atomic(using=db.alias))
    return stack


def _rendered(response: HttpResponseBase) -> HttpResponseBase:
    render = getattr(response, "render", None)
    if callable(render) and not getattr(response, "is_rendered", True):
        rendered = render()
        return rendered if isinstance(rendered, HttpResponseBase) else response
    return response


def _announce(request: HttpRequest, key: str, outcome: str) -> None:
    idempotent_request.send(sender=IdempotencyKey, request=request, key=key, outcome=outcome)


@dataclass(frozen=True)
class Policy:
    """How a view treats keys: required or optional, header or form token."""

    required: bool = True
    form: bool = False


def run(
    request: HttpRequest,
    view: Callable[[], HttpResponseBase],
    policy: Policy,
    key: str | None,
) -> HttpResponseBase:
    """Run ``view`` at most once per (principal, method, route, key)."""
    try:
        if key is None:
            if policy.required:
                raise KeyMissing(f"send an {HEADER} header (or a token) with this request")
            with _atomic_requests():
                return _rendered(view())
        principal = get_principal(request)
        if principal is None:
            raise NotAuthenticated("idempotency keys need an authenticated caller or a session")
        if policy.form:
            # A form's fields were parsed already (maybe streamed: multipart), so
            # the limit is checked on the declared length and the fields hashed.
            check_length(request)
            fp = _form_fp(request)
        else:
            fp = fingerprint(request, read_body(request))
        outcome = claim(
            principal=principal,
            key=key,
            method=request.method or "",
            route=request.path,
            fingerprint=fp,
            is_form=policy.form,
        )
    except IdempotencyError as exc:
        if key is not None and policy.form and isinstance(exc, KeyInFlight):
            waited = _wait_for_first(request, key, policy)
            if waited is not None:
                return waited
        if key is not None:
            _announce(request, key, exc.code)
        return problem_from(exc)
    if isinstance(outcome, IdempotencyKey):
        return _answer_completed(request, key, outcome, policy)
    return _execute(request, view, policy, key, outcome)


def _form_fp(request: HttpRequest) -> str:
    from idempotent_orders.http.forms import form_fingerprint

    return form_fingerprint(request)


def _answer_completed(
    request: HttpRequest, key: str, row: IdempotencyKey, policy: Policy
) -> HttpResponseBase:
    if policy.form:
        from idempotent_orders.http.forms import redirect_to_result

        _announce(request, key, "redirected")
        return redirect_to_result(row)
    _announce(request, key, "replayed")
    return replay(row)


def _wait_for_first(request: HttpRequest, key: str, policy: Policy) -> HttpResponseBase | None:
    """A form's second submit waits for the first one, then lands on the same result."""
    principal = get_principal(request) or ""
    scope = scope_of(principal, request.method or "", request.path)
    deadline = time.monotonic() + conf.FORM_WAIT
    while time.monotonic() < deadline:
        time.sleep(0.1)
        row = IdempotencyKey.objects.filter(scope=scope, key=key).first()
        if row is None:
            return None  # released (the first submit failed): answer 409, the user retries
        if row.state == KeyState.COMPLETED:
            return _answer_completed(request, key, row, policy)
        if row.lease_expires_at is not None and row.lease_expires_at <= timezone.now():
            return None
    return None


def _execute(
    request: HttpRequest,
    view: Callable[[], HttpResponseBase],
    policy: Policy,
    key: str,
    held: Claim,
) -> HttpResponseBase:
    try:
        with heartbeat(held), _atomic_requests():
            response = _rendered(view())
            keep = response.status_code < 500 and (
                not policy.form or 300 <= response.status_code < 400
            )
            if keep:
                # Under ATOMIC_REQUESTS the response commits with the view's writes.
                store(held, response)
    except BaseException:
        release(held)
        _announce(request, key, "released")
        raise
    if not keep:
        release(held)
        _announce(request, key, "released")
    else:
        _announce(request, key, "executed")
    return response


def header_key(request: HttpRequest) -> str | None:
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    return parse_key(raw)


def _guarded(view: View, policy: Policy, key_of: Callable[[HttpRequest], str | None]) -> View:
    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        if request.method not in UNSAFE_METHODS:
            with _atomic_requests():
                return view(request, *args, **kwargs)
        try:
            key = key_of(request)
        except IdempotencyError as exc:
            return problem_from(exc)
        return run(request, lambda: view(request, *args, **kwargs), policy, key)

    # The claim must commit before the view runs, so Django's ATOMIC_REQUESTS
    # wrapper is replaced by our own around the view (see _atomic_requests).
    return transaction.non_atomic_requests(wrapper)


def idempotent(view: V | None = None, *, required: bool = True) -> Any:
    """Decorate a function view: POST/PUT/PATCH/DELETE run once per ``Idempotency-Key``.

    ``@idempotent`` requires the header (400 without it); ``@idempotent(required=False)``
    runs keyless requests normally. A token from the token endpoint works as the key.
    """

    def decorate(func: V) -> V:
        guarded: Any = _guarded(func, Policy(required=required), header_key)
        return guarded

    return decorate(view) if view is not None else decorate


class IdempotentMixin:
    """Class-based-view mixin with the same behaviour as :func:`idempotent`."""

    idempotency_required: bool = True

    @classmethod
    def as_view(cls, **initkwargs: Any) -> Any:
        view = super().as_view(**initkwargs)  # type: ignore[misc]
        return _guarded(view, Policy(required=cls.idempotency_required), header_key)


def purge_expired(*, now: Any = None) -> int:
    """Delete expired keys and tokens (not a claim whose lease is still live)."""
    now = now or timezone.now()
    deleted, _ = (
        IdempotencyKey.objects.filter(expires_at__lte=now)
        .exclude(state=KeyState.IN_FLIGHT, lease_expires_at__gt=now)
        .delete()
    )
    return deleted
