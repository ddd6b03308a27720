"""django-ninja: ``@idempotent_operation`` on sync and async operations."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from tests import http_urls
from tests.support.services import unavailable

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.http_urls")]


@pytest.fixture(autouse=True)
def _needs_ninja() -> None:
    if not hasattr(http_urls, "ninja_api"):
        unavailable("django-ninja is not installed", hint="pip install --group test")
    http_urls.RUNS.clear()


@pytest.fixture
def client() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_user("alice", password="pw"))
    return client


def post(client: Client, url: str, body: Any, key: str | None) -> Any:
    headers = {} if key is None else {"Idempotency-Key": key}
    return client.post(url, json.dumps(body), content_type="application/json", headers=headers)


@pytest.mark.parametrize("flavour", ["", "a"], ids=["sync", "async"])
def test_an_operation_runs_once_per_key(client: Client, flavour: str) -> None:
    url = f"/t/ninja/{flavour}things"
    first = post(client, url, {"name": "x"}, "k")
    assert first.status_code == 200, first.content
    assert json.loads(first.content) == {"run": 1, "name": "x"}
    again = post(client, url, {"name": "x"}, "k")
    assert (again.status_code, again["Idempotent-Replayed"]) == (200, "true")
    assert again.content == first.content
    mismatch = post(client, url, {"name": "y"}, "k")
    assert (mismatch.status_code, json.loads(mismatch.content)["code"]) == (422, "key-mismatch")
    missing = post(client, url, {"name": "x"}, None)
    assert (missing.status_code, json.loads(missing.content)["code"]) == (400, "key-missing")
    assert http_urls.RUNS[f"{flavour}ninja"] == 1


def test_safe_methods_pass_through(client: Client) -> None:
    assert post(client, "/t/ninja/things", {"name": "x"}, "k").status_code == 200
    response = client.get("/t/ninja/things")
    assert (response.status_code, json.loads(response.content)) == (200, {"runs": 1})
    assert "Idempotent-Replayed" not in response


@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.services
def test_under_atomic_requests_copies_wait_for_the_first(
    live_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ninja's URL view cannot be exempted from ATOMIC_REQUESTS, so the claim
    # commits with the request: copies wait for it and get its replay.
    from django.db import connection

    from tests.support.http import request, session_cookie, together

    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    cookie = session_cookie("bob")
    results = together(
        10,
        lambda _i: request(
            live_server.url, "/t/ninja/things", cookie=cookie, key="same", body={"name": "x"}
        ),
    )
    assert not [r for r in results if isinstance(r, Exception)], results
    answers = sorted((r[0], r[1].get("Idempotent-Replayed", "")) for r in results)
    assert answers == [(200, "")] + [(200, "true")] * 9, answers
    assert http_urls.RUNS["ninja"] == 1
