"""The HTTP key claim behind PgBouncer's transaction pooling and under Django's psycopg pool,
with no setting to remember (PostgreSQL only)."""

from __future__ import annotations

import hashlib
import itertools
import random
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client, override_settings
from django.urls import path

from idempotent_orders import prepared as sessions
from idempotent_orders.http import claim_sql, idempotent_view
from idempotent_orders.models import IdempotencyKey
from tests.support.pgbouncer import pgbouncer

pytestmark = [
    # Poolers in front of PostgreSQL: the postgres legs of the matrix.
    pytest.mark.backends("postgresql"),
    pytest.mark.django_db(transaction=True),
]

#: How many times the view ran, per key.
executed: Counter[str] = Counter()
_runs_lock = threading.Lock()


@idempotent_view
def once(request: HttpRequest) -> HttpResponse:
    key = request.headers["Idempotency-Key"]
    with _runs_lock:
        executed[key] += 1
    return JsonResponse({"key": key}, status=201)


def principal(request: HttpRequest) -> str:
    """A few principals (one header), so claims of several quota locks interleave."""
    return f"client:{request.headers.get('X-Principal', 'p0')}"


urlpatterns = [path("once/", once)]


@pytest.fixture(autouse=True)
def _postgres_and_this_view() -> Iterator[None]:
    executed.clear()
    io = {**settings.IDEMPOTENT_ORDERS, "PRINCIPAL_RESOLVER": f"{__name__}.principal"}
    with override_settings(ROOT_URLCONF=__name__, IDEMPOTENT_ORDERS=io):
        yield


@contextmanager
def new_connections(**changes: Any) -> Iterator[None]:
    """Connections of the default alias opened from now on (each thread opens its own)
    use ``changes``; the ones open already keep their settings."""
    saved = connections.settings[DEFAULT_DB_ALIAS]
    connections.settings[DEFAULT_DB_ALIAS] = {**saved, **changes}
    try:
        yield
    finally:
        connections.settings[DEFAULT_DB_ALIAS] = saved


def claim(client: Client, key: str) -> int:
    owner = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 3
    response = client.post(
        "/once/",
        data={"item": "book"},
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
        HTTP_X_PRINCIPAL=f"p{owner}",
    )
    return int(response.status_code)


@dataclass
class Storm:
    statuses: Counter[int] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    used: set[str] = field(default_factory=set)
    #: Claims whose prepared statements were missing: the pooler changed servers.
    misses: int = 0


def storm(threads: int, requests: int, shared: int) -> Storm:
    """``threads`` clients, each sending ``requests`` claims: half of them new keys, half
    one of ``shared`` keys every thread uses.

    Each client sends its first claim alone, one after the other (a pooler serves them
    from one idle server connection, so they prepare there), then all send the rest
    at once (the pooler opens more server connections, which never saw a PREPARE).
    """
    found = Storm()
    fresh = itertools.count()
    guard = threading.Lock()
    turns = [threading.Event() for _ in range(threads + 1)]
    turns[0].set()
    start = threading.Barrier(threads)

    def one(web: Client, rng: random.Random) -> None:
        with guard:
            key = f"new-{next(fresh)}" if rng.random() < 0.5 else None
        key = key or f"shared-{rng.randrange(shared)}"
        status = claim(web, key)
        with guard:
            found.statuses[status] += 1
            found.used.add(key)

    def client(n: int) -> None:
        rng = random.Random(n)
        web = Client(raise_request_exception=True)
        try:
            assert turns[n].wait(60)
            try:
                one(web, rng)
            finally:
                turns[n + 1].set()
            start.wait(60)
            for _ in range(requests - 1):
                one(web, rng)
            session = sessions._sessions.get(connections[DEFAULT_DB_ALIAS].connection)
            missed = 0 if session is None else session.misses
            with guard:
                found.misses += missed
        except Exception as exc:  # every error is the test's finding
            with guard:
                found.errors.append(repr(exc))
        finally:
            connections.close_all()

    workers = [threading.Thread(target=client, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(300)
    assert not any(w.is_alive() for w in workers), "a client hung"
    return found


def test_claims_through_pgbouncer_transaction_pooling_run_each_key_once() -> None:
    db = connections.settings[DEFAULT_DB_ALIAS]
    with pgbouncer(db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432), db["USER"]) as port:
        # Persistent client connections (the claim prepares its statements on them),
        # and no DISABLE_SERVER_SIDE_CURSORS to remember.
        changes = {"HOST": "127.0.0.1", "PORT": str(port), "CONN_MAX_AGE": 600}
        with new_connections(**changes):
            found = storm(threads=8, requests=40, shared=20)
    assert found.errors == []
    # The case that broke: the pooler served a client from a server it had not prepared on.
    assert found.misses >= 1
    assert set(found.statuses) <= {201, 409}, found.statuses
    assert sum(found.statuses.values()) == 8 * 40
    assert {key for key, runs in executed.items() if runs != 1} == set()
    assert set(executed) == found.used
    assert IdempotencyKey.objects.filter(key__in=found.used).count() == len(found.used)


def test_the_claim_is_prepared_on_a_pooled_connection() -> None:
    # One connection in Django's pool, so every request checks out the same one.
    pool = {"pool": {"min_size": 1, "max_size": 1}}
    prepared: list[str] = []

    def requests() -> None:
        web = Client(raise_request_exception=True)
        try:
            for n in range(4):
                assert claim(web, f"pooled-{n}") == 201
            with connections[DEFAULT_DB_ALIAS].cursor() as cursor:
                cursor.execute(
                    "SELECT name FROM pg_prepared_statements"
                    " WHERE name LIKE 'idempotent_orders_claim_%' ORDER BY name"
                )
                prepared.extend(name for (name,) in cursor.fetchall())
        finally:
            connections[DEFAULT_DB_ALIAS].close()
            connections[DEFAULT_DB_ALIAS].close_pool()

    db = connections.settings[DEFAULT_DB_ALIAS]
    with new_connections(CONN_MAX_AGE=0, OPTIONS={**db["OPTIONS"], **pool}):
        worker = threading.Thread(target=requests)
        worker.start()
        worker.join(120)
    assert [name.rsplit("_", 1)[0] for name in prepared] == [
        "idempotent_orders_claim_insert",
        "idempotent_orders_claim_lock",
        "idempotent_orders_claim_read",
    ]
    assert executed == Counter({f"pooled-{n}": 1 for n in range(4)})


def test_a_session_that_lost_or_already_has_the_statements_claims_all_the_same() -> None:
    outcomes: list[tuple[int, bool, bool]] = []

    def requests() -> None:
        web = Client(raise_request_exception=True)
        db = connections[DEFAULT_DB_ALIAS]

        def claimed(key: str) -> None:
            status = claim(web, key)
            raw = db.connection
            names = claim_sql._prepared_sql[DEFAULT_DB_ALIAS].names
            outcomes.append((status, sessions.holds(raw, names), sessions.gave_up(raw)))

        try:
            claimed("lost-0")  # prepared by the query that runs it
            db.close()
            # A new session that has them already (a pooler's server another client
            # prepared, or an earlier query of its own that failed after its PREPAREs).
            db.ensure_connection()
            with db.cursor() as cursor:
                cursor.execute("; ".join(claim_sql._prepared_sql[DEFAULT_DB_ALIAS].prepares))
            claimed("lost-1")
            for n in range(2, 8, 2):
                with db.cursor() as cursor:
                    cursor.execute("DEALLOCATE ALL")  # as a pooler's other server would be
                claimed(f"lost-{n}")  # missed, sent as text
                claimed(f"lost-{n + 1}")  # prepared again, until the third miss
        finally:
            connections.close_all()

    with new_connections(CONN_MAX_AGE=600):
        worker = threading.Thread(target=requests)
        worker.start()
        worker.join(120)
    assert outcomes == [
        (201, True, False),
        (201, True, False),
        (201, False, False),
        (201, True, False),
        (201, False, False),
        (201, True, False),
        (201, False, True),
        (201, False, True),
    ]
    assert Counter({f"lost-{n}": 1 for n in range(8)}) == executed
