"""The response of a claimed key: stored once, replayed to every retry.

The response is stored (status, the headers ``REPLAY_HEADERS`` allows, body
bytes) by one ``UPDATE`` fenced by the claim's lease owner, which releases the
lease in the same statement, and replayed to retries with
``Idempotent-Replayed: true``. Streaming responses and bodies over
``MAX_STORED_RESPONSE_BYTES`` are stored without their body. On PostgreSQL the
``UPDATE`` that ends a view's transaction is sent with its ``COMMIT``, one round
trip (:func:`store`'s ``commit``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.db import DEFAULT_DB_ALIAS, DataError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.http import HttpResponse, HttpResponseBase
from django.utils import timezone

from idempotent_orders.conf import conf
from idempotent_orders.models import IdempotencyKey, KeyState
from idempotent_orders.prepared import driver_cursor, fetch_one
from idempotent_orders.vendors import vendor

if TYPE_CHECKING:
    from idempotent_orders.http.lease import KeyClaim

__all__ = ["replay", "store"]

logger = logging.getLogger("idempotent_orders")


def _field(name: str) -> Any:
    return IdempotencyKey._meta.get_field(name)


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
#: PostgreSQL: the UPDATE that fails when it updated no row (the lease was lost), then
#: ``COMMIT``, by database alias.
_store_commit_sql: dict[str, str] = {}
#: What the database answers to that statement's division by no updated row.
_LEASE_LOST_SQLSTATE = "22012"
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


def _can_commit(conn: BaseDatabaseWrapper) -> bool:
    """Whether the UPDATE may end the transaction itself: PostgreSQL through psycopg 3
    with client-side binding (a simple query may hold two statements), the
    caller's ``atomic`` block the outermost one, nothing marked for rollback."""
    chosen = vendor(conn)
    if not (chosen.writes_in_with and chosen.several_statements(conn)):
        return False
    return len(conn.atomic_blocks) == 1 and not conn.needs_rollback and conn.connection is not None


def _committing(conn: BaseDatabaseWrapper, sql: str) -> str:
    found = _store_commit_sql.get(conn.alias)
    if found is None:
        # A lost lease updates no row, and the division by that count fails the
        # statement: PostgreSQL then skips the COMMIT after it and the transaction
        # stays open, aborted, for the caller to roll back.
        found = _store_commit_sql[conn.alias] = (
            f"WITH stored AS ({sql}) SELECT 1 / (SELECT COUNT(*) FROM stored)::integer; COMMIT"
        )
    return found


def store(held: KeyClaim, response: HttpResponseBase, *, commit: bool = False) -> bool:
    """Store ``response`` under the key; False when the lease was lost to a takeover.

    ``commit``: the caller's outermost ``atomic`` block ends right after this
    statement, so on PostgreSQL the statement commits it in the same round trip
    (Django's own commit at the end of the block then finds nothing to commit).
    A lost lease commits nothing: the transaction is left aborted, to be rolled back.
    """
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
        if vendor(conn).prepares:  # run by fetch_one, which reads the row
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
    if commit and _can_commit(conn):
        try:
            # Straight to the driver where nothing must see the statement.
            cursor = driver_cursor(conn, in_transaction=True)
            if cursor is None:
                with conn.cursor() as cursor:
                    cursor.execute(_committing(conn, sql), _named(args))
            else:
                with conn.wrap_database_errors, cursor:
                    cursor.execute(_committing(conn, sql), _named(args))
            stored = True
        except DataError as exc:
            if getattr(exc.__cause__, "sqlstate", None) != _LEASE_LOST_SQLSTATE:
                raise
            stored = False
    elif vendor(conn).prepares:
        # A prepared statement of the session from its second use on.
        stored = fetch_one(sql, args, conn) is not None
    else:
        with conn.cursor() as cursor:
            cursor.execute(sql, _named(args))
            stored = bool(cursor.rowcount)
    if not stored:
        logger.warning(
            "idempotency key %s lost its lease before the response was stored", held.row.pk
        )
    return stored


def _named(args: list[Any]) -> dict[str, Any]:
    return {f"a{n}": value for n, value in enumerate(args)}


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
