"""The response of a claimed key: stored once, replayed to every retry.

The response is stored (status, the headers ``REPLAY_HEADERS`` allows, body
bytes) by one ``UPDATE`` fenced by the claim's lease owner, and replayed to
retries with ``Idempotent-Replayed: true``. Streaming responses and bodies over
``MAX_STORED_RESPONSE_BYTES`` are stored without their body.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.http import HttpResponse, HttpResponseBase
from django.utils import timezone

from idempotent_orders.conf import conf
from idempotent_orders.consuming.sql import fetch_one
from idempotent_orders.models import IdempotencyKey, KeyState

if TYPE_CHECKING:
    from idempotent_orders.http.claims import KeyClaim

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


def store(held: KeyClaim, response: HttpResponseBase) -> bool:
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
