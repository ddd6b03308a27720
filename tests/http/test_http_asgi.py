"""Async views under a real ASGI server (uvicorn, in a thread) on a real database."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from idempotent_orders.models import IdempotencyKey, KeyState, Order
from tests import http_urls
from tests.support.http import assert_one_execution, request, session_cookie, together
from tests.support.services import free_port, unavailable, wait_until

pytestmark = [
    pytest.mark.backends("postgresql", "mysql"),
    pytest.mark.urls("tests.http_urls"),
    pytest.mark.services,
]

COPIES = 50


@pytest.fixture
def asgi_server(transactional_db: None) -> Iterator[str]:
    """The test settings' ASGI application served by uvicorn on a free port."""
    try:
        import uvicorn
    except ImportError:
        unavailable("uvicorn is not installed", hint="pip install --group test")
    from django.core.asgi import get_asgi_application

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            get_asgi_application(),
            host="127.0.0.1",
            port=port,
            lifespan="off",
            log_level="warning",
            backlog=512,
        )
    )
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, timeout=30), "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        connection.close()


@pytest.fixture(autouse=True)
def _reset() -> None:
    http_urls.RUNS.clear()
    http_urls.RENDEZVOUS.clear()


def test_concurrent_identical_requests_run_an_async_view_once(asgi_server: str) -> None:
    cookie = session_cookie("alice")
    path = "/t/aorder/?sleep=0.2"
    results = together(COPIES, lambda _i: request(asgi_server, path, cookie=cookie, key="same"))
    assert not [r for r in results if isinstance(r, Exception)], results
    assert http_urls.RUNS["aorder"] == 1
    original = assert_one_execution(results, Order.objects.get().pk, COPIES)
    assert IdempotencyKey.objects.get().state == KeyState.COMPLETED
    # The replay path: a retry after the storm gets the original, marked.
    status, headers, body = request(asgi_server, path, cookie=cookie, key="same")
    assert (status, headers["Idempotent-Replayed"], body) == (201, "true", original[2])
    # Same key, other body: 422; no key: 400. Neither runs the view.
    status, _headers, body = request(asgi_server, path, cookie=cookie, key="same", body={})
    assert (status, json.loads(body)["code"]) == (422, "key-mismatch")
    status, _headers, body = request(asgi_server, path, cookie=cookie, key=None)
    assert (status, json.loads(body)["code"]) == (400, "key-missing")
    assert http_urls.RUNS["aorder"] == 1
    assert Order.objects.count() == 1


def test_keyed_async_views_run_side_by_side_on_the_event_loop(asgi_server: str) -> None:
    # ``first`` waits inside its view until ``second`` has run. If the claim or the
    # view blocked the server's event loop, ``second`` could not start and
    # ``first`` would time out (500) instead.
    cookie = session_cookie("alice")
    answers: dict[str, Any] = {}

    def first() -> None:
        answers["first"] = request(
            asgi_server, "/t/rendezvous/first/", cookie=cookie, key="one", body={}
        )

    thread = threading.Thread(target=first)
    thread.start()
    assert wait_until(lambda: "event" in http_urls.RENDEZVOUS, timeout=30)
    second = request(asgi_server, "/t/rendezvous/second/", cookie=cookie, key="two", body={})
    thread.join(60)
    assert second[0] == 201, second
    assert answers["first"][0] == 201, answers["first"]
    assert (http_urls.RUNS["first"], http_urls.RUNS["second"]) == (1, 1)
    assert IdempotencyKey.objects.filter(state=KeyState.COMPLETED).count() == 2


def test_heartbeat_keeps_a_slow_async_view_from_running_twice(
    asgi_server: str, settings: Any
) -> None:
    settings.IDEMPOTENT_ORDERS = {"KEY_LEASE": 1}
    cookie = session_cookie("alice")
    path = "/t/aorder/?sleep=3"
    slow = threading.Thread(
        target=request, args=(asgi_server, path), kwargs={"cookie": cookie, "key": "slow"}
    )
    slow.start()
    # Ask again well after the 1 s lease would have expired without heartbeats.
    threading.Event().wait(2)
    status, _headers, body = request(asgi_server, path, cookie=cookie, key="slow")
    slow.join(30)
    assert status == 409, body
    status, headers, body = request(asgi_server, path, cookie=cookie, key="slow")
    assert (status, headers["Idempotent-Replayed"]) == (201, "true")
    assert http_urls.RUNS["aorder"] == 1
    assert Order.objects.count() == 1


def test_concurrent_identical_requests_run_an_async_ninja_operation_once(asgi_server: str) -> None:
    if not hasattr(http_urls, "ninja_api"):
        unavailable("django-ninja is not installed", hint="pip install --group test")
    cookie = session_cookie("alice")
    path = "/t/ninja/athings?sleep=0.2"
    results = together(
        20, lambda _i: request(asgi_server, path, cookie=cookie, key="same", body={"name": "x"})
    )
    assert not [r for r in results if isinstance(r, Exception)], results
    assert http_urls.RUNS["aninja"] == 1
    statuses = sorted((r[0], r[1].get("Idempotent-Replayed", "")) for r in results if r[0] != 409)
    assert statuses[0] == (200, ""), statuses
    assert all(s == (200, "true") for s in statuses[1:]), statuses
    assert {json.loads(r[2])["run"] for r in results if r[0] == 200} == {1}
