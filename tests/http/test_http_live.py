"""Concurrent identical requests against a live server on a real database."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from django.db import connection

from idempotent_orders import orders
from idempotent_orders.conf import conf
from idempotent_orders.models import IdempotencyKey, KeyState, Order
from tests import http_urls
from tests.support.corpus import HTTP_BAD_BODIES
from tests.support.http import ORDER, assert_one_execution, request, session_cookie, together

pytestmark = [
    pytest.mark.backends("postgresql", "mysql"),
    pytest.mark.urls("tests.http_urls"),
    pytest.mark.services,
]

THREADS = 30


@pytest.mark.parametrize("atomic_requests", [False, True], ids=["autocommit", "atomic"])
def test_concurrent_identical_requests_create_one_order(
    live_server: Any, monkeypatch: pytest.MonkeyPatch, atomic_requests: bool
) -> None:
    # The live server's thread opens its connections from these settings.
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", atomic_requests)
    cookie = session_cookie("alice")
    results = together(
        THREADS,
        lambda _i: request(live_server.url, "/api/orders/", cookie=cookie, key="same-key"),
    )
    assert not [r for r in results if isinstance(r, Exception)], results
    assert Order.objects.count() == 1
    original = assert_one_execution(results, Order.objects.get().pk, THREADS)
    row = IdempotencyKey.objects.get()
    assert row.state == KeyState.COMPLETED
    # A retry after the storm replays the original.
    status, headers, body = request(live_server.url, "/api/orders/", cookie=cookie, key="same-key")
    assert (status, headers["Idempotent-Replayed"]) == (201, "true")
    assert body == original[2]


def test_concurrent_creates_with_different_keys_meet_on_the_business_key(
    live_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every request in one ORDER_WINDOW: a storm that straddled a window's end would be two
    # business orders (the documented price of a key without state), on a slow machine.
    middle = (time.time() // conf.ORDER_WINDOW + 0.5) * conf.ORDER_WINDOW
    monkeypatch.setattr(orders, "time", SimpleNamespace(time=lambda: middle))
    cookie = session_cookie("alice")
    results = together(
        THREADS,
        lambda i: request(live_server.url, "/api/orders/", cookie=cookie, key=f"key-{i}"),
    )
    assert not [r for r in results if isinstance(r, Exception)], results
    assert sorted(r[0] for r in results) == [200] * (THREADS - 1) + [201]
    order = Order.objects.get()
    assert {json.loads(r[2])["id"] for r in results} == {order.pk}


def test_other_users_same_key_concurrently_neither_replay_nor_block(live_server: Any) -> None:
    alice, bob = session_cookie("alice"), session_cookie("bob")
    results = together(
        20,
        lambda i: request(
            live_server.url, "/api/orders/", cookie=alice if i % 2 else bob, key="shared"
        ),
    )
    assert not [r for r in results if isinstance(r, Exception)], results
    assert Order.objects.count() == 2
    for cookie in (alice, bob):
        mine = [r for r, c in zip(results, [bob, alice] * 10, strict=True) if c == cookie]
        ids = {json.loads(r[2])["id"] for r in mine if r[0] == 201}
        assert len(ids) == 1
        assert all(r[0] in (201, 409) for r in mine)
    by_customer = {o.customer.username: o.pk for o in Order.objects.all()}
    assert set(by_customer) == {"alice", "bob"}


@pytest.mark.parametrize("atomic_requests", [False, True], ids=["autocommit", "atomic"])
def test_heartbeat_keeps_a_slow_view_from_running_twice(
    live_server: Any, settings: Any, monkeypatch: pytest.MonkeyPatch, atomic_requests: bool
) -> None:
    # Under ATOMIC_REQUESTS this also shows the claim committed on its own: a
    # claim inside the request's transaction would block the second request
    # until the first commits, and it would get a replay, not a 409.
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", atomic_requests)
    settings.IDEMPOTENT_ORDERS = {"KEY_LEASE": 1}
    http_urls.RUNS.clear()
    cookie = session_cookie("alice")
    slow = threading.Thread(
        target=request,
        args=(live_server.url, "/t/slow/?sleep=3"),
        kwargs={"cookie": cookie, "key": "slow", "body": {}},
    )
    slow.start()
    # Ask again well after the 1 s lease would have expired without heartbeats.
    threading.Event().wait(2)
    status, headers, body = request(
        live_server.url, "/t/slow/?sleep=3", cookie=cookie, key="slow", body={}
    )
    slow.join(30)
    assert status == 409, body
    assert http_urls.RUNS["slow"] == 1
    status, headers, body = request(
        live_server.url, "/t/slow/?sleep=3", cookie=cookie, key="slow", body={}
    )
    assert (status, headers["Idempotent-Replayed"]) == (201, "true")
    assert http_urls.RUNS["slow"] == 1


def test_a_view_that_outlives_the_key_ttl_runs_once(live_server: Any, settings: Any) -> None:
    # The heartbeat keeps the lease live past KEY_TTL; the key must not be
    # forgotten as expired while its view is still running.
    settings.IDEMPOTENT_ORDERS = {"KEY_LEASE": 1, "KEY_TTL": 2}
    http_urls.RUNS.clear()
    cookie = session_cookie("alice")
    slow = threading.Thread(
        target=request,
        args=(live_server.url, "/t/slow/?sleep=4"),
        kwargs={"cookie": cookie, "key": "slow", "body": {}},
    )
    slow.start()
    threading.Event().wait(3)  # past KEY_TTL, before the view ends
    status, _headers, body = request(
        live_server.url, "/t/slow/?sleep=4", cookie=cookie, key="slow", body={}
    )
    slow.join(30)
    assert status == 409, body
    assert http_urls.RUNS["slow"] == 1


@pytest.mark.parametrize("atomic_requests", [False, True], ids=["autocommit", "atomic"])
def test_concurrent_first_uses_never_exceed_the_key_quota(
    live_server: Any, settings: Any, monkeypatch: pytest.MonkeyPatch, atomic_requests: bool
) -> None:
    # Each request counts the caller's live keys and inserts its own: without
    # serializing the two per principal, requests counting at the same instant
    # would all see room left and all be accepted.
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", atomic_requests)
    settings.IDEMPOTENT_ORDERS = {"KEY_QUOTA": 5}
    cookie = session_cookie("alice")
    results = together(
        THREADS,
        lambda i: request(
            live_server.url,
            "/api/orders/",
            cookie=cookie,
            key=f"quota-{i}",
            body={**ORDER, "items": [{"sku": f"tea-{i}", "quantity": 1}]},
        ),
    )
    assert not [r for r in results if isinstance(r, Exception)], results
    statuses = sorted(r[0] for r in results)
    assert statuses == [201] * 5 + [429] * (THREADS - 5), statuses
    assert IdempotencyKey.objects.filter(state=KeyState.COMPLETED).count() == 5
    assert IdempotencyKey.objects.count() == 5
    assert Order.objects.count() == 5


def test_hostile_bodies_through_a_real_server_are_400_problems(live_server: Any) -> None:
    # Through the server's own stack (WSGI handler, a real socket): no 500, and
    # nothing but the key's stored 400 left behind.
    cookie = session_cookie("alice")
    for n, case in enumerate(HTTP_BAD_BODIES):
        status, headers, body = request(
            live_server.url, "/api/orders/", cookie=cookie, key=f"bad-{n}", body=case.body
        )
        assert status == 400, (case.name, status, body[:200])
        assert headers["Content-Type"] == "application/problem+json", case.name
        assert json.loads(body)["code"] == "invalid-order", case.name
    assert not Order.objects.exists()
    assert not IdempotencyKey.objects.exclude(state=KeyState.COMPLETED).exists()


def test_an_anonymous_cookieless_retry_through_a_real_server_is_refused_not_run_twice(
    live_server: Any,
) -> None:
    http_urls.RUNS.clear()
    answers = [
        request(live_server.url, "/t/slow/", cookie="", key="anon", body={}) for _ in range(2)
    ]
    for status, headers, body in answers:
        assert status == 401, body
        assert headers["Content-Type"] == "application/problem+json"
        assert json.loads(body)["code"] == "session-required"
        assert "sessionid" not in headers.get("Set-Cookie", "")
    assert "slow" not in http_urls.RUNS
    assert not IdempotencyKey.objects.exists()
