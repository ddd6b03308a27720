"""Idempotency-Key, tokens, forms, orders API and business keys through Django's test client."""

from __future__ import annotations

import base64
import json
import threading
import uuid
from datetime import timedelta
from decimal import Decimal
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone

from idempotent_orders.checks import check_http_settings, check_setting_values
from idempotent_orders.exceptions import KeyInvalid
from idempotent_orders.http.forms import FORM_FIELD
from idempotent_orders.http.keys import TOKEN_PREFIX, parse_key, scope_of
from idempotent_orders.http.tokens import issue_token
from idempotent_orders.models import IdempotencyKey, KeyState, Order
from idempotent_orders.orders import create_order
from tests import http_urls
from tests.support.corpus import HTTP_BAD_BODIES, BadBody

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.http_urls")]

ORDER = {"amount": "12.50", "currency": "CNY", "items": [{"sku": "tea", "quantity": 1}]}


@pytest.fixture(autouse=True)
def _reset_runs() -> None:
    http_urls.RUNS.clear()
    http_urls.PAUSE.clear()


@pytest.fixture(params=["", "a"], ids=["sync", "async"])
def flavour(request: pytest.FixtureRequest) -> str:
    """A test view's name prefix: ``counter`` is a ``def`` view, ``acounter`` ``async def``."""
    return str(request.param)


@pytest.fixture
def alice() -> Any:
    return get_user_model().objects.create_user("alice", password="pw")


@pytest.fixture
def bob() -> Any:
    return get_user_model().objects.create_user("bob", password="pw")


def client_for(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def post(client: Client, url: str, body: Any = ORDER, key: str | None = None, **extra: Any):
    headers = {} if key is None else {"Idempotency-Key": key}
    return client.post(
        url,
        data=json.dumps(body) if not isinstance(body, bytes) else body,
        content_type="application/json",
        headers=headers,
        **extra,
    )


def problem(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/problem+json"
    data = json.loads(response.content)
    assert data["status"] == status
    assert data["code"] == code
    assert data["type"] == f"urn:idempotent-orders:{code}"
    assert data["title"]
    return data


# --- parsing ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ('"abc-123"', "abc-123"),
        ("abc-123", "abc-123"),
        ('"with space"', "with space"),
        (r'"q\"uote\\d"', 'q"uote\\d'),
        ("  padded  ", "padded"),
    ],
)
def test_parse_key_accepts_sf_string_and_bare(raw: str, key: str) -> None:
    assert parse_key(raw) == key


@pytest.mark.parametrize(
    "raw",
    [
        '""',
        "",
        "   ",
        '"open',
        r'"bad\escape"',
        '"in"side"',
        "two words",
        "ké",
        '"ké"',
        "a\x01b",
        "k" * 256,
        '"' + "k" * 256 + '"',
    ],
)
def test_parse_key_rejects(raw: str) -> None:
    with pytest.raises(KeyInvalid):
        parse_key(raw)


def test_key_length_limit_is_a_setting(settings: Any) -> None:
    settings.IDEMPOTENT_ORDERS = {"KEY_MAX_LENGTH": 8}
    assert parse_key("k" * 8) == "k" * 8
    with pytest.raises(KeyInvalid):
        parse_key("k" * 9)


# --- the Idempotency-Key header ----------------------------------------------


def test_first_request_runs_and_retry_replays(alice: Any, flavour: str) -> None:
    client = client_for(alice)
    first = post(client, f"/t/{flavour}counter/", key="k1")
    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first
    again = post(client, f"/t/{flavour}counter/", key='"k1"')  # the sf-string form is the same key
    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert again["Location"] == first["Location"]
    assert again["Content-Type"] == "application/json"
    # Only allow-listed headers are stored: never cookies or internal headers.
    assert "X-Internal" not in again
    assert "secret" not in again.cookies
    assert http_urls.RUNS[flavour + "counter"] == 1
    row = IdempotencyKey.objects.get()
    assert row.state == KeyState.COMPLETED
    assert row.response_status == 201


def test_missing_key_is_400_and_nothing_runs(alice: Any, flavour: str) -> None:
    problem(post(client_for(alice), f"/t/{flavour}counter/"), 400, "key-missing")
    assert flavour + "counter" not in http_urls.RUNS


def test_optional_key_runs_keyless_requests(alice: Any, flavour: str) -> None:
    client = client_for(alice)
    assert post(client, f"/t/{flavour}optional/").status_code == 201
    assert post(client, f"/t/{flavour}optional/").status_code == 201
    assert http_urls.RUNS[flavour + "optional"] == 2
    assert not IdempotencyKey.objects.exists()


def test_safe_methods_pass_through(alice: Any, flavour: str) -> None:
    assert client_for(alice).get(f"/t/{flavour}counter/").status_code == 201
    assert not IdempotencyKey.objects.exists()


@pytest.mark.parametrize("raw", ["", '""', "k" * 256, "schlüssel", "two words", '"unterminated'])
def test_invalid_key_is_400_and_changes_nothing(alice: Any, raw: str, flavour: str) -> None:
    response = post(client_for(alice), f"/t/{flavour}counter/", key=raw)
    problem(response, 400, "key-invalid")
    assert flavour + "counter" not in http_urls.RUNS
    assert not IdempotencyKey.objects.exists()


def test_different_payload_same_key_is_422(alice: Any, flavour: str) -> None:
    client = client_for(alice)
    assert post(client, f"/t/{flavour}counter/", key="k").status_code == 201
    problem(post(client, f"/t/{flavour}counter/", {"other": 1}, key="k"), 422, "key-mismatch")
    problem(post(client, f"/t/{flavour}counter/?x=1", key="k"), 422, "key-mismatch")
    assert http_urls.RUNS[flavour + "counter"] == 1


def test_same_key_other_route_is_another_scope(alice: Any, flavour: str) -> None:
    client = client_for(alice)
    assert post(client, f"/t/{flavour}counter/", key="k").status_code == 201
    assert post(client, f"/t/{flavour}optional/", key="k").status_code == 201
    assert IdempotencyKey.objects.count() == 2


def in_flight_counter_key(
    user: Any, flavour: str, key: str, *, owner: str, lease: timedelta
) -> None:
    """A claim on POST /t/[a]counter/ by another process; its lease ends ``lease`` from now."""
    route = f"/t/{flavour}counter/"
    IdempotencyKey.objects.create(
        scope=scope_of(f"user:{user.pk}", "POST", route),
        key=key,
        principal=f"user:{user.pk}",
        method="POST",
        route=route,
        fingerprint=_fingerprint(route, ORDER),
        state=KeyState.IN_FLIGHT,
        lease_owner=owner,
        lease_expires_at=timezone.now() + lease,
        expires_at=timezone.now() + timedelta(days=1),
    )


def test_in_flight_is_409_with_retry_after(alice: Any, flavour: str) -> None:
    in_flight_counter_key(alice, flavour, "busy", owner="someone", lease=timedelta(seconds=30))
    response = post(client_for(alice), f"/t/{flavour}counter/", key="busy")
    problem(response, 409, "key-in-flight")
    assert response["Retry-After"] == "1"
    assert flavour + "counter" not in http_urls.RUNS


def test_expired_lease_is_taken_over(alice: Any, flavour: str) -> None:
    in_flight_counter_key(
        alice, flavour, "crashed", owner="dead-worker", lease=-timedelta(seconds=1)
    )
    assert post(client_for(alice), f"/t/{flavour}counter/", key="crashed").status_code == 201
    assert http_urls.RUNS[flavour + "counter"] == 1
    assert IdempotencyKey.objects.get().state == KeyState.COMPLETED


def _fingerprint(path: str, body: Any) -> str:
    from django.test import RequestFactory

    from idempotent_orders.http.keys import fingerprint

    request = RequestFactory().post(path, json.dumps(body), content_type="application/json")
    return fingerprint(request, request.body)


def test_5xx_is_not_stored_and_the_key_can_be_retried(alice: Any, flavour: str) -> None:
    client = client_for(alice)
    assert post(client, f"/t/{flavour}fails/", key="k").status_code == 503
    assert not IdempotencyKey.objects.exists()
    assert post(client, f"/t/{flavour}fails/", key="k").status_code == 201
    assert post(client, f"/t/{flavour}fails/", key="k")["Idempotent-Replayed"] == "true"
    assert http_urls.RUNS[flavour + "fails"] == 2


def test_exception_releases_the_key(alice: Any, flavour: str) -> None:
    client = client_for(alice)
    client.raise_request_exception = False
    assert post(client, f"/t/{flavour}raises/", key="k").status_code == 500
    assert not IdempotencyKey.objects.exists()
    assert post(client, f"/t/{flavour}raises/", key="k").status_code == 201


@pytest.fixture(params=[False, True], ids=["autocommit", "atomic-requests"])
def atomic_requests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", request.param)
    return bool(request.param)


@pytest.mark.parametrize("fail", ["502", "raise"])
def test_a_view_that_wrote_then_failed_is_rolled_back_before_its_key_is_released(
    alice: Any, atomic_requests: bool, fail: str
) -> None:
    client = client_for(alice)
    client.raise_request_exception = False
    url = "/t/writes_then_fails/?fail=" + fail
    assert post(client, url, key="k").status_code == (502 if fail == "502" else 500)
    assert not Order.objects.exists()  # the failed run's write was rolled back
    assert not IdempotencyKey.objects.exists()  # and the key released
    again = post(client, url, key="k")
    assert again.status_code == 201
    assert Order.objects.count() == 1
    assert post(client, url, key="k")["Idempotent-Replayed"] == "true"
    assert http_urls.RUNS["writes_then_fails"] == 2
    assert Order.objects.count() == 1


@pytest.mark.parametrize("fail", ["502", "raise"])
@pytest.mark.parametrize("view", ["writes_then_fails_store", "awrites_then_fails"])
def test_a_view_that_wrote_then_failed_keeps_its_failure_under_store(
    alice: Any, atomic_requests: bool, fail: str, view: str
) -> None:
    # on_failure="store", an async view's default: the failure is the key's answer.
    client = client_for(alice)
    client.raise_request_exception = False
    url = f"/t/{view}/?fail={fail}"
    first = post(client, url, key="k")
    assert first.status_code == (502 if fail == "502" else 500)
    again = post(client, url, key="k")
    assert again["Idempotent-Replayed"] == "true"
    assert again.status_code == first.status_code
    if fail == "502":
        assert again.content == first.content == b"bad gateway"
    else:
        problem(again, 500, "view-failed")
    assert http_urls.RUNS[view] == 1
    # The write stayed, once; under ATOMIC_REQUESTS a sync view's exception rolled it back.
    rolled_back = fail == "raise" and atomic_requests and not view.startswith("a")
    assert Order.objects.count() == (0 if rolled_back else 1)


def test_on_failure_is_checked_when_the_view_is_decorated() -> None:
    from django.core.exceptions import ImproperlyConfigured

    from idempotent_orders.http import idempotent_view

    async def aview(request: Any) -> Any: ...

    def view(request: Any) -> Any: ...

    with pytest.raises(ImproperlyConfigured, match="async view"):
        idempotent_view(on_failure="rollback")(aview)
    with pytest.raises(ImproperlyConfigured, match="on_failure"):
        idempotent_view(on_failure="ignore")(view)  # type: ignore[arg-type]


def test_streaming_response_is_stored_without_body(alice: Any) -> None:
    client = client_for(alice)
    first = post(client, "/t/streaming/", key="k")
    assert b"".join(first.streaming_content) == b"chunk-1,chunk-2"
    again = post(client, "/t/streaming/", key="k")
    assert again.status_code == 200
    assert again["Idempotent-Replayed"] == "true"
    assert again["Idempotent-Body-Omitted"] == "true"
    assert again.content == b""
    assert http_urls.RUNS["streaming"] == 1


def test_oversized_response_is_stored_without_body(alice: Any, settings: Any) -> None:
    settings.IDEMPOTENT_ORDERS = {"MAX_STORED_RESPONSE_BYTES": 1000}
    client = client_for(alice)
    assert len(post(client, "/t/large/", key="k").content) == 5000
    again = post(client, "/t/large/", key="k")
    assert (again.status_code, again.content) == (201, b"")
    assert again["Idempotent-Body-Omitted"] == "true"
    assert http_urls.RUNS["large"] == 1


def test_body_over_the_cap_is_413_and_changes_nothing(alice: Any, settings: Any) -> None:
    settings.IDEMPOTENT_ORDERS = {"MAX_REQUEST_BYTES": 100}
    response = post(client_for(alice), "/t/counter/", {"pad": "x" * 200}, key="k")
    problem(response, 413, "body-too-large")
    assert not IdempotencyKey.objects.exists()
    assert "counter" not in http_urls.RUNS


def test_key_flooding_past_the_quota_is_429(
    alice: Any, bob: Any, settings: Any, flavour: str
) -> None:
    settings.IDEMPOTENT_ORDERS = {"KEY_QUOTA": 3}
    client = client_for(alice)
    for i in range(3):
        assert post(client, f"/t/{flavour}counter/", key=f"k{i}").status_code == 201
    response = post(client, f"/t/{flavour}counter/", key="k3")
    problem(response, 429, "quota-exceeded")
    assert response["Retry-After"]
    assert IdempotencyKey.objects.count() == 3
    # Replays of keys already held still work, and other principals are not affected.
    assert post(client, f"/t/{flavour}counter/", key="k0")["Idempotent-Replayed"] == "true"
    assert post(client_for(bob), f"/t/{flavour}counter/", key="k3").status_code == 201


def test_another_user_can_neither_replay_nor_block(alice: Any, bob: Any, flavour: str) -> None:
    a, b = client_for(alice), client_for(bob)
    first = post(a, f"/t/{flavour}counter/", key="shared")
    theirs = post(b, f"/t/{flavour}counter/", key="shared")
    assert theirs.status_code == 201
    assert "Idempotent-Replayed" not in theirs  # bob's request ran: no replay of alice's
    assert json.loads(theirs.content)["run"] == 2
    assert post(a, f"/t/{flavour}counter/", key="shared").content == first.content
    # An in-flight key of alice's does not block bob either.
    IdempotencyKey.objects.filter(principal=f"user:{alice.pk}").update(
        state=KeyState.IN_FLIGHT, lease_owner="x", lease_expires_at=timezone.now() + timedelta(1)
    )
    assert post(b, f"/t/{flavour}counter/", key="shared")["Idempotent-Replayed"] == "true"
    assert post(b, f"/t/{flavour}counter/", key="other").status_code == 201


def client_principal(request: Any) -> str | None:
    """A ``PRINCIPAL_RESOLVER``: the API client named by the ``X-Client`` header."""
    return request.META.get("HTTP_X_CLIENT")


def test_long_principals_differing_only_at_the_end_are_kept_apart(
    settings: Any, flavour: str
) -> None:
    settings.IDEMPOTENT_ORDERS = {
        "PRINCIPAL_RESOLVER": f"{__name__}.client_principal",
        "KEY_QUOTA": 1,  # one quota for both would refuse the second client
    }
    one, two = "c" * 249 + "1", "c" * 249 + "2"
    client = Client()
    url = f"/t/{flavour}counter/"
    first = post(client, url, key="k", HTTP_X_CLIENT=one)
    second = post(client, url, key="k", HTTP_X_CLIENT=two)
    assert (first.status_code, second.status_code) == (201, 201), second.content
    assert "Idempotent-Replayed" not in second
    assert json.loads(second.content)["run"] == 2
    assert post(client, url, key="k", HTTP_X_CLIENT=one).content == first.content
    assert post(client, url, key="k", HTTP_X_CLIENT=two).content == second.content
    stored = set(IdempotencyKey.objects.values_list("principal", flat=True))
    assert len(stored) == 2
    assert all(len(p) <= 191 and p.startswith("c" * 100) for p in stored)
    # Nor a token: one client's is refused to the other, and stays the owner's.
    settings.IDEMPOTENT_ORDERS = {"PRINCIPAL_RESOLVER": f"{__name__}.client_principal"}
    token = issue_token(one).key
    problem(post(client, url, key=token, HTTP_X_CLIENT=two), 403, "token-invalid")
    assert post(client, url, key=token, HTTP_X_CLIENT=one).status_code == 201


def test_a_principal_is_stored_whole_up_to_190_characters() -> None:
    from idempotent_orders.http.keys import stored_principal

    assert stored_principal("user:1") == "user:1"
    assert stored_principal("c" * 190) == "c" * 190
    long = stored_principal("c" * 191)
    assert len(long) == 191
    assert long != "c" * 191
    assert stored_principal("c" * 191) != stored_principal("c" * 190 + "d")


def test_anonymous_keys_are_scoped_to_the_session(flavour: str) -> None:
    one, two = Client(), Client()
    shop_token(one), shop_token(two)  # a page load gives each its session
    assert post(one, f"/t/{flavour}counter/", key="k").status_code == 201
    assert post(one, f"/t/{flavour}counter/", key="k")["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in post(two, f"/t/{flavour}counter/", key="k")
    assert http_urls.RUNS[flavour + "counter"] == 2


def test_class_based_view_mixin(alice: Any, flavour: str) -> None:
    client = client_for(alice)
    problem(post(client, f"/t/{flavour}cbv/"), 400, "key-missing")
    assert post(client, f"/t/{flavour}cbv/", key="k").status_code == 201
    assert post(client, f"/t/{flavour}cbv/", key="k")["Idempotent-Replayed"] == "true"
    assert http_urls.RUNS[flavour + "cbv"] == 1


def test_drf_mixin(alice: Any) -> None:
    client = client_for(alice)
    first = post(client, "/t/drf/", {"a": 1}, key="k")
    assert first.status_code == 201
    assert json.loads(first.content) == {"run": 1, "echo": {"a": 1}}
    again = post(client, "/t/drf/", {"a": 1}, key="k")
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    problem(post(client, "/t/drf/", {"a": 2}, key="k"), 422, "key-mismatch")
    problem(post(client, "/t/drf/", {"a": 1}), 400, "key-missing")
    assert http_urls.RUNS["drf"] == 1


@pytest.mark.parametrize(
    "authorization", ["Basic " + base64.b64encode(b"alice:wrong").decode(), "Basic !!!"]
)
def test_a_failed_drf_login_is_a_401_problem_leaving_no_key_and_no_session(
    alice: Any, authorization: str
) -> None:
    # It once fell back to a new anonymous session, claimed the key under it and
    # stored DRF's 401 there: a key row and a session for every failed login.
    from django.contrib.sessions.models import Session

    response = post(Client(), "/t/drf/", {"a": 1}, key="k", HTTP_AUTHORIZATION=authorization)
    problem(response, 401, "not-authenticated")
    assert response.get("WWW-Authenticate", "").startswith("Basic")
    assert "sessionid" not in response.cookies
    assert not IdempotencyKey.objects.exists()
    assert not Session.objects.exists()
    assert "drf" not in http_urls.RUNS


def test_drf_viewset_registered_with_a_router(alice: Any) -> None:
    client = client_for(alice)
    body = {"amount": "12.50", "currency": "CNY"}
    first = post(client, "/t/drf/router/orders/", body, key="k")
    assert first.status_code == 201, first.content
    assert "Idempotent-Replayed" not in first
    again = post(client, "/t/drf/router/orders/", body, key="k")
    assert (again.status_code, again["Idempotent-Replayed"]) == (201, "true")
    assert again.content == first.content
    assert Order.objects.count() == 1
    assert http_urls.RUNS["viewset-create"] == 1
    # Without the header a create is refused; safe methods pass through.
    problem(post(client, "/t/drf/router/orders/", body), 400, "key-missing")
    order = Order.objects.get()
    assert client.get("/t/drf/router/orders/").status_code == 200
    assert client.get(f"/t/drf/router/orders/{order.pk}/").status_code == 200
    # Every action that changes state is keyed: updates, deletes and extra actions.
    detail = f"/t/drf/router/orders/{order.pk}/"
    problem(client.patch(detail, "{}", content_type="application/json"), 400, "key-missing")
    problem(client.delete(detail), 400, "key-missing")
    problem(post(client, f"{detail}cancel/", {}), 400, "key-missing")
    assert post(client, f"{detail}cancel/", {}, key="c").status_code == 200
    assert post(client, f"{detail}cancel/", {}, key="c")["Idempotent-Replayed"] == "true"
    assert http_urls.RUNS["viewset-cancel"] == 1
    assert client.delete(detail, headers={"Idempotency-Key": "d"}).status_code == 204
    assert client.delete(detail, headers={"Idempotency-Key": "d"}).status_code == 204
    assert not Order.objects.exists()


def test_keys_work_under_atomic_requests(alice: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from django.db import connection

    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    client = client_for(alice)
    assert post(client, "/api/orders/", key="k").status_code == 201
    assert post(client, "/api/orders/", key="k")["Idempotent-Replayed"] == "true"
    assert Order.objects.count() == 1


def taken_over_while_paused(client: Client, path: str, key: str) -> dict[str, Any]:
    """A pause hook: the holder's process froze past its lease (no heartbeat ran), and
    a retry, from another connection, took the key over and finished. Returns the
    retry's response once the hook has run."""
    retried: dict[str, Any] = {}

    def retry() -> None:
        try:
            IdempotencyKey.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
            retried["response"] = post(client, path, key=key)
        finally:
            connection.close()

    def pause() -> None:
        thread = threading.Thread(target=retry)
        thread.start()
        thread.join(60)

    http_urls.PAUSE.append(pause)
    return retried


@pytest.mark.django_db(transaction=True)
@pytest.mark.backends("postgresql", "mysql")  # SQLite: the view's BEGIN IMMEDIATE blocks the retry
def test_a_holder_that_lost_its_claim_commits_nothing_in_its_transaction(
    alice: Any, atomic_requests: bool
) -> None:
    # A def view runs in a transaction (on_failure="rollback"), ATOMIC_REQUESTS or not.
    client = client_for(alice)
    retried = taken_over_while_paused(client, "/t/paused/", "k")
    first = post(client, "/t/paused/", key="k")
    second = retried["response"]
    assert second.status_code == 201
    assert http_urls.RUNS["paused"] == 2  # both ran: the pause outlived the lease
    # Only the winner's writes committed, and the stale holder answers as a later
    # copy would: with the winner's stored response.
    order = Order.objects.get()
    assert json.loads(second.content)["id"] == order.pk
    assert first.status_code == 201
    assert first["Idempotent-Replayed"] == "true"
    assert first.content == second.content
    row = IdempotencyKey.objects.get()
    assert (row.state, bytes(row.response_body)) == (KeyState.COMPLETED, second.content)


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)  # outside a transaction, as a request runs
def test_the_stored_response_commits_the_views_transaction_in_its_round_trip(
    alice: Any, atomic_requests: bool
) -> None:
    from django.test.utils import CaptureQueriesContext

    client = client_for(alice)
    with CaptureQueriesContext(connection) as queries:
        first = post(client, "/api/orders/", key="one-trip")
    assert first.status_code == 201
    stores = [q["sql"] for q in queries if 'UPDATE "idempotent_orders_idempotencykey"' in q["sql"]]
    assert len(stores) == 1
    assert stores[0].rstrip().endswith("; COMMIT")
    # Committed with the order: another connection sees both.
    assert Order.objects.count() == 1
    assert post(client, "/api/orders/", key="one-trip").content == first.content
    # Inside a transaction the caller owns, the statement commits nothing.
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        assert post(client, "/api/orders/", basket("b"), key="inside").status_code == 201
        transaction.set_rollback(True)
    assert not any(q["sql"].rstrip().endswith("COMMIT") for q in queries)
    assert not IdempotencyKey.objects.filter(key="inside").exists()


@pytest.mark.django_db(transaction=True)
def test_a_holder_that_lost_its_claim_never_stores_outside_a_transaction(
    alice: Any, flavour: str
) -> None:
    # A def view under on_failure="store" without ATOMIC_REQUESTS; async views take
    # this road too: Django runs them outside ATOMIC_REQUESTS.
    from idempotent_orders.signals import idempotent_request

    client = client_for(alice)
    url = "/t/apaused/" if flavour else "/t/paused_store/"
    retried = taken_over_while_paused(client, url, "k")
    outcomes: list[str] = []

    def record(sender: Any, outcome: str, **kwargs: Any) -> None:
        outcomes.append(outcome)

    idempotent_request.connect(record)
    try:
        first = post(client, url, key="k")
    finally:
        idempotent_request.disconnect(record)
    second = retried["response"]
    assert sorted(outcomes) == ["executed", "lease-lost"]
    # Without ATOMIC_REQUESTS the stale holder's writes were committed as it made
    # them (the README says so); its response is its own, and the key keeps the winner's.
    assert (first.status_code, second.status_code) == (201, 201)
    assert "Idempotent-Replayed" not in first
    assert json.loads(first.content)["run"] == 1
    assert Order.objects.count() == 2
    row = IdempotencyKey.objects.get()
    assert (row.state, bytes(row.response_body)) == (KeyState.COMPLETED, second.content)
    assert post(client, url, key="k").content == second.content


def test_a_live_lease_is_never_expired_by_the_key_ttl(alice: Any, flavour: str) -> None:
    # The view has run past KEY_TTL but its holder still heart-beats: the key is
    # in flight, not forgotten.
    in_flight_counter_key(alice, flavour, "long", owner="running", lease=timedelta(seconds=30))
    IdempotencyKey.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    response = post(client_for(alice), f"/t/{flavour}counter/", key="long")
    problem(response, 409, "key-in-flight")
    assert flavour + "counter" not in http_urls.RUNS
    assert IdempotencyKey.objects.get().lease_owner == "running"


def test_heartbeat_keeps_the_key_alive_past_its_ttl(alice: Any, settings: Any) -> None:
    from idempotent_orders.http.keys import KeyClaim, renew

    settings.IDEMPOTENT_ORDERS = {"KEY_LEASE": 30}
    in_flight_counter_key(alice, "", "long", owner="running", lease=timedelta(seconds=1))
    row = IdempotencyKey.objects.get()
    IdempotencyKey.objects.update(expires_at=timezone.now() + timedelta(seconds=2))
    renew(KeyClaim(row, "running"))
    row.refresh_from_db()
    assert row.lease_expires_at > timezone.now() + timedelta(seconds=20)
    assert row.expires_at >= row.lease_expires_at
    # Another holder's beat changes nothing.
    before = (row.lease_expires_at, row.expires_at)
    IdempotencyKey.objects.update(lease_owner="someone-else")
    renew(KeyClaim(row, "running"))
    row.refresh_from_db()
    assert (row.lease_expires_at, row.expires_at) == before


def test_the_heartbeat_thread_is_woken_only_for_a_beat_due_before_it_wakes(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from idempotent_orders.http import lease

    settings.IDEMPOTENT_ORDERS = {"KEY_LEASE": 30}
    beater = lease._Beater()
    notified: list[int] = []
    notify = beater.cond.notify
    monkeypatch.setattr(beater.cond, "notify", lambda: (notified.append(1), notify()))
    held = lease.KeyClaim(IdempotencyKey(pk=1), "owner")
    first = beater.add(held)  # starts the thread
    assert beater.thread is not None
    assert beater.thread.is_alive()
    deadline = time.monotonic() + 10
    while beater.wake_at == float("inf") and time.monotonic() < deadline:
        time.sleep(0.01)
    beater.remove(first)
    # A request's claim is due a whole interval from now, never before the thread wakes:
    # adding and removing it costs no thread switch.
    for _ in range(3):
        beater.remove(beater.add(held))
    assert notified == []
    # A shorter lease (settings changed) is due before that wake-up: the thread is woken.
    settings.IDEMPOTENT_ORDERS = {"KEY_LEASE": 0.3}
    short = beater.add(held)
    assert notified == [1]
    beater.remove(short)


# --- tokens ------------------------------------------------------------------


def token_for(client: Client) -> str:
    response = client.post("/api/idempotency-tokens/", "{}", content_type="application/json")
    assert response.status_code == 201, response.content
    data = json.loads(response.content)
    assert set(data) == {"token", "expires_at"}
    assert data["token"].startswith(TOKEN_PREFIX)
    return str(data["token"])


def test_token_endpoint(alice: Any) -> None:
    client = client_for(alice)
    one, two = token_for(client), token_for(client)
    assert one != two
    assert len(one) > 40  # 32 random bytes
    row = IdempotencyKey.objects.get(key=one)
    assert (row.state, row.principal, row.is_token) == (KeyState.ISSUED, f"user:{alice.pk}", True)


def test_token_endpoint_refuses_anonymous_wrong_method_and_media_type(alice: Any) -> None:
    problem(
        Client().post("/api/idempotency-tokens/", "{}", content_type="application/json"),
        401,
        "not-authenticated",
    )
    client = client_for(alice)
    assert client.get("/api/idempotency-tokens/").status_code == 405
    problem(client.post("/api/idempotency-tokens/", {"a": "b"}), 415, "unsupported-media-type")
    assert not IdempotencyKey.objects.exists()


def test_token_quota(alice: Any, settings: Any) -> None:
    settings.IDEMPOTENT_ORDERS = {"TOKEN_QUOTA": 2}
    client = client_for(alice)
    token_for(client)
    token_for(client)
    response = client.post("/api/idempotency-tokens/", "{}", content_type="application/json")
    problem(response, 429, "quota-exceeded")
    assert IdempotencyKey.objects.count() == 2


def test_token_as_key_is_single_use(alice: Any) -> None:
    client = client_for(alice)
    token = token_for(client)
    first = post(client, "/api/orders/", key=token)
    assert first.status_code == 201
    row = IdempotencyKey.objects.get(key=token)
    assert (row.state, row.route) == (KeyState.COMPLETED, "/api/orders/")
    # Reuse with the same request replays; with another request it is refused.
    assert post(client, "/api/orders/", key=token).content == first.content
    other = {**ORDER, "amount": "99.00"}
    problem(post(client, "/api/orders/", other, key=token), 422, "key-mismatch")
    assert Order.objects.count() == 1


def test_token_of_another_principal_is_403_and_changes_nothing(alice: Any, bob: Any) -> None:
    token = token_for(client_for(alice))
    problem(post(client_for(bob), "/api/orders/", key=token), 403, "token-invalid")
    row = IdempotencyKey.objects.get(key=token)
    assert (row.state, row.principal) == (KeyState.ISSUED, f"user:{alice.pk}")
    assert not Order.objects.exists()
    assert post(client_for(alice), "/api/orders/", key=token).status_code == 201


def test_unknown_expired_or_rerouted_token_is_403(alice: Any) -> None:
    client = client_for(alice)
    problem(post(client, "/api/orders/", key=TOKEN_PREFIX + "made-up"), 403, "token-invalid")
    expired = token_for(client)
    IdempotencyKey.objects.filter(key=expired).update(expires_at=timezone.now())
    problem(post(client, "/api/orders/", key=expired), 403, "token-invalid")
    used = token_for(client)
    assert post(client, "/t/counter/", key=used).status_code == 201
    problem(post(client, "/api/orders/", key=used), 403, "token-invalid")
    assert not Order.objects.exists()


def test_5xx_gives_a_token_back(alice: Any, flavour: str) -> None:
    client = client_for(alice)
    token = token_for(client)
    assert post(client, f"/t/{flavour}fails/", key=token).status_code == 503
    row = IdempotencyKey.objects.get(key=token)
    assert (row.state, row.route) == (KeyState.ISSUED, "")
    assert post(client, f"/t/{flavour}fails/", key=token).status_code == 201


# --- orders API ------------------------------------------------------------------


def test_orders_api_create_and_read(alice: Any, bob: Any) -> None:
    client = client_for(alice)
    response = post(client, "/api/orders/", key="order-1")
    assert response.status_code == 201
    data = json.loads(response.content)
    assert data == {
        "id": data["id"],
        "status": "pending_payment",
        "amount": "12.50",
        "currency": "CNY",
        "version": 0,
    }
    order = Order.objects.get()
    assert order.customer == alice
    assert json.loads(client.get(f"/api/orders/{order.pk}/").content) == data
    problem(client_for(bob).get(f"/api/orders/{order.pk}/"), 404, "not-found")
    problem(Client().get(f"/api/orders/{order.pk}/"), 401, "not-authenticated")
    staff = get_user_model().objects.create_user("staff", is_staff=True)
    assert client_for(staff).get(f"/api/orders/{order.pk}/").status_code == 200


def test_orders_api_same_basket_other_key_is_the_same_order(alice: Any) -> None:
    client = client_for(alice)
    first = json.loads(post(client, "/api/orders/", key="a").content)
    again = post(client, "/api/orders/", key="b")
    assert again.status_code == 200  # found by business key, not created
    assert json.loads(again.content)["id"] == first["id"]
    assert Order.objects.count() == 1


def test_orders_api_requires_login_and_a_key(alice: Any) -> None:
    problem(post(Client(), "/api/orders/", key="k"), 401, "not-authenticated")
    problem(post(client_for(alice), "/api/orders/"), 400, "key-missing")
    assert not Order.objects.exists()


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        [],
        {**ORDER, "amount": 12.5},
        {**ORDER, "amount": "-1"},
        {**ORDER, "amount": "1.234"},
        {**ORDER, "amount": "NaN"},
        {**ORDER, "amount": "1e12"},
        {**ORDER, "currency": "cny"},
        {**ORDER, "currency": "人民币"},
        {**ORDER, "items": []},
        {**ORDER, "items": [{"sku": "", "quantity": 1}]},
        {**ORDER, "items": [{"sku": "tea", "quantity": 0}]},
        {**ORDER, "items": [{"sku": "tea", "quantity": True}]},
        {**ORDER, "items": ["tea"]},
    ],
)
def test_orders_api_rejects_bad_input(alice: Any, body: Any) -> None:
    problem(post(client_for(alice), "/api/orders/", body, key="k"), 400, "invalid-order")
    assert not Order.objects.exists()


@pytest.mark.parametrize("case", HTTP_BAD_BODIES, ids=lambda c: c.name)
def test_orders_api_answers_hostile_bodies_with_a_problem_and_stores_nothing_half(
    alice: Any, case: BadBody
) -> None:
    # Deep nesting once raised RecursionError, huge amounts InvalidOperation (500s);
    # non-ASCII digits were accepted although the consumer refuses them.
    client = client_for(alice)
    problem(post(client, "/api/orders/", case.body, key="k"), 400, "invalid-order")
    assert not Order.objects.exists()
    assert not IdempotencyKey.objects.exclude(state=KeyState.COMPLETED).exists()
    # The key answers the same problem again; the body is never run twice.
    again = post(client, "/api/orders/", case.body, key="k")
    problem(again, 400, "invalid-order")
    assert not Order.objects.exists()


def test_orders_api_needs_json(alice: Any) -> None:
    response = client_for(alice).post(
        "/api/orders/", {"amount": "1"}, headers={"Idempotency-Key": "k"}
    )
    problem(response, 415, "unsupported-media-type")


# --- business keys ------------------------------------------------------------------


def test_business_key_same_basket_same_window(alice: Any, bob: Any) -> None:
    items = [{"sku": "a", "quantity": 1}, {"sku": "b", "quantity": 2}]
    kwargs: dict[str, Any] = {"amount": Decimal("3"), "currency": "CNY", "window": 300}
    order, created = create_order(customer=alice, items=items, at=1000.0, **kwargs)
    assert created
    shuffled = [
        {"sku": "b", "quantity": 1},
        {"sku": "a", "quantity": 1},
        items[1] | {"quantity": 1},
    ]
    assert create_order(customer=alice, items=shuffled, at=1199.0, **kwargs) == (order, False)
    assert create_order(customer=alice, items=items, at=1200.0, **kwargs)[1]  # next window
    assert create_order(customer=bob, items=items, at=1000.0, **kwargs)[1]
    assert create_order(customer=None, items=items, at=1000.0, anonymous_id="s1", **kwargs)[1]
    assert create_order(customer=None, items=items, at=1000.0, anonymous_id="s2", **kwargs)[1]
    with pytest.raises(ValueError, match="at least one item"):
        create_order(customer=alice, items=[], at=1000.0, **kwargs)


def win_the_race_from_another_connection() -> list[int]:
    """A pre_save hook: before the first order is inserted, another connection inserts
    and commits one with the same business key. Returns the winner's id once run."""
    from django.db.models.signals import pre_save

    won: list[int] = []
    started: list[bool] = []

    def insert(instance: Order) -> None:
        try:
            won.append(
                Order.objects.create(
                    business_key=instance.business_key, amount=Decimal("1"), currency="CNY"
                ).pk
            )
        finally:
            connection.close()

    def hook(sender: Any, instance: Order, **kwargs: Any) -> None:
        if not started:  # once (the winner's own save comes here too)
            started.append(True)
            thread = threading.Thread(target=insert, args=(instance,))
            thread.start()
            thread.join(30)

    pre_save.connect(hook, sender=Order, weak=False, dispatch_uid="race")
    return won


@pytest.fixture
def race() -> Any:
    from django.db.models.signals import pre_save

    yield win_the_race_from_another_connection()
    pre_save.disconnect(sender=Order, dispatch_uid="race")


@pytest.mark.backends("postgresql", "mysql")  # SQLite: the view's BEGIN IMMEDIATE holds the writer
@pytest.mark.django_db(transaction=True)
def test_a_keyed_create_takes_no_savepoint_and_a_lost_race_runs_the_view_again(
    alice: Any, atomic_requests: bool, race: list[int]
) -> None:
    from django.test.utils import CaptureQueriesContext

    client = client_for(alice)
    with CaptureQueriesContext(connection) as queries:
        response = post(client, "/api/orders/", key="raced")
    # The first run's INSERT lost to the winner's; the second run found the winner.
    assert response.status_code == 200, response.content
    assert json.loads(response.content)["id"] == race[0]
    assert Order.objects.count() == 1
    assert not any("SAVEPOINT" in q["sql"] for q in queries)
    assert post(client, "/api/orders/", key="raced").content == response.content
    # Without a race, a new order: still no savepoint.
    with CaptureQueriesContext(connection) as queries:
        assert post(client, "/api/orders/", basket("calm"), key="calm").status_code == 201
    assert not any("SAVEPOINT" in q["sql"] for q in queries)


@pytest.mark.backends("postgresql", "mysql")
@pytest.mark.django_db(transaction=True)
def test_create_order_in_a_callers_transaction_survives_a_lost_race(
    alice: Any, race: list[int]
) -> None:
    items = [{"sku": "tea", "quantity": 1}]
    with transaction.atomic():
        order, created = create_order(
            customer=alice, items=items, amount=Decimal("1"), currency="CNY"
        )
        # The caller's transaction goes on after the lost race.
        assert Order.objects.filter(pk=order.pk).exists()
    assert (order.pk, created) == (race[0], False)


# --- forms ---------------------------------------------------------------------------


def shop_token(client: Client) -> str:
    page = client.get("/shop/")
    assert page.status_code == 200
    html = page.content.decode()
    marker = f'name="{FORM_FIELD}" value="'
    start = html.index(marker) + len(marker)
    return html[start : html.index('"', start)]


def checkout(client: Client, token: str | None, **quantities: int) -> Any:
    data = {f"qty-{sku}": str(n) for sku, n in quantities.items()}
    if token is not None:
        data[FORM_FIELD] = token
    return client.post("/shop/checkout/", data)


def test_form_double_submit_redirects_to_the_first_result() -> None:
    client = Client()
    token = shop_token(client)
    assert token.startswith(TOKEN_PREFIX)
    first = checkout(client, token, **{"tea-longjing": 2})
    assert first.status_code == 303
    order = Order.objects.get()
    assert first["Location"] == f"/shop/orders/{order.pk}/"
    second = checkout(client, token, **{"tea-longjing": 2})
    assert (second.status_code, second["Location"]) == (303, first["Location"])
    assert Order.objects.count() == 1
    page = client.get(first["Location"])
    assert page.status_code == 200
    assert f'data-order-id="{order.pk}"' in page.content.decode()
    assert order.amount == Decimal("176.00")


def test_form_invalid_submit_gives_the_token_back() -> None:
    client = Client()
    token = shop_token(client)
    assert checkout(client, token).status_code == 400
    assert IdempotencyKey.objects.get(key=token).state == KeyState.ISSUED
    assert checkout(client, token, **{"cup-celadon": 1}).status_code == 303
    assert Order.objects.count() == 1


def test_form_token_of_another_session_is_refused() -> None:
    token = shop_token(Client())
    other = Client()
    other.get("/shop/")
    problem(checkout(other, token, **{"cup-celadon": 1}), 403, "token-invalid")
    assert not Order.objects.exists()
    assert IdempotencyKey.objects.get(key=token).state == KeyState.ISSUED


def test_form_needs_a_token_and_refuses_a_client_key() -> None:
    client = Client()
    shop_token(client)
    problem(checkout(client, None, **{"cup-celadon": 1}), 400, "key-missing")
    problem(checkout(client, "", **{"cup-celadon": 1}), 400, "key-invalid")
    problem(checkout(client, "my-own-key", **{"cup-celadon": 1}), 403, "token-invalid")
    assert not Order.objects.exists()


def test_form_token_changed_basket_is_422() -> None:
    client = Client()
    token = shop_token(client)
    assert checkout(client, token, **{"cup-celadon": 1}).status_code == 303
    problem(checkout(client, token, **{"cup-celadon": 5}), 422, "key-mismatch")
    assert Order.objects.count() == 1


def test_template_tag_evicts_the_oldest_tokens_past_the_quota(settings: Any) -> None:
    settings.IDEMPOTENT_ORDERS = {"TOKEN_QUOTA": 3}
    client = Client()
    tokens = [shop_token(client) for _ in range(5)]
    kept = set(IdempotencyKey.objects.values_list("key", flat=True))
    assert kept == set(tokens[-3:])


# --- expiry, purge and checks ------------------------------------------------------------


def test_expired_key_is_forgotten_and_purged(alice: Any) -> None:
    client = client_for(alice)
    assert post(client, "/t/counter/", key="old").status_code == 201
    IdempotencyKey.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert "Idempotent-Replayed" not in post(client, "/t/counter/", key="old")
    assert http_urls.RUNS["counter"] == 2
    issue_token(f"user:{alice.pk}")
    live_claim = IdempotencyKey.objects.create(
        scope="s",
        key="running",
        principal="p",
        state=KeyState.IN_FLIGHT,
        lease_expires_at=timezone.now() + timedelta(minutes=1),
        expires_at=timezone.now() - timedelta(seconds=1),
    )
    IdempotencyKey.objects.exclude(pk=live_claim.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    out = StringIO()
    call_command("purge_idempotency_keys", stdout=out)
    assert "purged 2 expired" in out.getvalue()
    assert list(IdempotencyKey.objects.all()) == [live_claim]


@pytest.mark.parametrize(
    ("value", "ids"),
    [
        ({"KEY_LEASE": 0}, ["idempotent_orders.E036"]),
        ({"KEY_MAX_LENGTH": 300}, ["idempotent_orders.E021"]),
        ({"PRINCIPAL_RESOLVER": "nowhere.resolver"}, ["idempotent_orders.E022"]),
        ({"KEY_TTL": 10, "KEY_LEASE": 30}, ["idempotent_orders.E023"]),
        ({"REPLAY_HEADERS": ["Location", "Set-Cookie"]}, ["idempotent_orders.E024"]),
        ({"KEY_TTL": 100}, []),
    ],
)
def test_checks(settings: Any, value: dict[str, Any], ids: list[str]) -> None:
    settings.IDEMPOTENT_ORDERS = value
    assert [m.id for m in [*check_http_settings(), *check_setting_values()]] == ids


def test_check_warns_without_sessions(settings: Any) -> None:
    settings.MIDDLEWARE = [m for m in settings.MIDDLEWARE if "Session" not in m]
    assert [m.id for m in check_http_settings()] == ["idempotent_orders.W020"]


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)  # outside a transaction, as a request runs
def test_a_replay_is_one_indexed_read_on_postgresql(alice) -> None:
    from django.test.utils import CaptureQueriesContext

    from idempotent_orders.http import claims

    client = client_for(alice)
    first = post(client, "/api/orders/", key="replay-once")
    assert first.status_code == 201
    stored = IdempotencyKey.objects.get(key="replay-once")
    args = {
        "principal": stored.principal,
        "key": "replay-once",
        "method": stored.method,
        "route": stored.route,
        "fingerprint": stored.fingerprint,
    }
    with CaptureQueriesContext(connection) as queries:
        found = claims.claim(**args)
    assert len(queries) == 1
    assert isinstance(found, IdempotencyKey)
    assert (found.pk, found.state, found.response_status) == (stored.pk, KeyState.COMPLETED, 201)
    assert found.response_body == stored.response_body
    assert IdempotencyKey.objects.filter(principal=stored.principal).count() == 1
    again = post(client, "/api/orders/", key="replay-once")
    assert (again.status_code, again.content) == (201, first.content)


def test_storing_the_response_updates_no_indexed_column() -> None:
    # So that on PostgreSQL the stored response is a heap-only update: no index entry
    # is written for it, and the response's commit flushes less.
    from idempotent_orders.http.replay import _STORE_COLUMNS

    meta = IdempotencyKey._meta
    indexed = {"id"}
    for index in [*meta.indexes, *meta.constraints]:
        indexed.update(getattr(index, "fields", ()))
    assert not indexed & set(_STORE_COLUMNS)


@pytest.mark.backends("postgresql")
def test_the_stored_response_is_a_heap_only_update_on_postgresql(alice: Any) -> None:
    def updates() -> tuple[int, int]:
        # Counts not yet flushed to the shared statistics: none is while this test's
        # transaction is open, so the difference is this request's.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = %s",
                [IdempotencyKey._meta.db_table],
            )
            row = cursor.fetchone()
        return (row[0], row[1]) if row else (0, 0)

    client = client_for(alice)
    before = updates()
    assert post(client, "/api/orders/", key="hot").status_code == 201
    after = updates()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    assert post(client, "/api/orders/", key="hot")["Idempotent-Replayed"] == "true"


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_a_session_authenticated_replay_writes_and_locks_nothing(alice: Any) -> None:
    client = client_for(alice)  # logged in by its session cookie
    first = post(client, "/api/orders/", key="pure-read")
    assert first.status_code == 201

    def versions() -> list[tuple[str, ...]]:
        # xmin changes when a row is written, xmax when it is locked or deleted.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT xmin::text, xmax::text FROM idempotent_orders_idempotencykey"
                " UNION ALL SELECT xmin::text, xmax::text FROM django_session"
                " UNION ALL SELECT xmin::text, xmax::text FROM idempotent_orders_keyquota"
            )
            return sorted(cursor.fetchall())

    before = versions()
    for _ in range(3):
        again = post(client, "/api/orders/", key="pure-read")
        assert (again.status_code, again["Idempotent-Replayed"]) == (201, "true")
        assert again.content == first.content
        assert "sessionid" not in again.cookies  # the session was not saved again
    assert versions() == before
    assert Order.objects.count() == 1


def basket(sku: str) -> dict[str, Any]:
    return {**ORDER, "items": [{"sku": sku, "quantity": 1}]}


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)  # outside a transaction, as a request runs
def test_the_claim_runs_prepared_statements_and_prepares_them_again_when_lost(
    alice: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.test.utils import CaptureQueriesContext

    # Persistent connections (prepared once, used by many requests).
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 60)
    client = client_for(alice)
    connection.close()  # a fresh connection: nothing prepared on it yet
    with CaptureQueriesContext(connection) as queries:
        assert post(client, "/api/orders/", basket("p-1"), key="p-1").status_code == 201
    sql = [q["sql"] for q in queries]
    # Once per connection, in the same query (one transaction) as the first EXECUTEs.
    assert sum(s.startswith("PREPARE ") for s in sql) == 1
    assert any(
        s.startswith("PREPARE ") and "; EXECUTE idempotent_orders_claim_read" in s for s in sql
    )
    with CaptureQueriesContext(connection) as queries:
        assert post(client, "/api/orders/", basket("p-2"), key="p-2").status_code == 201
    assert not any(q["sql"].startswith("PREPARE ") for q in queries)
    # A pooler's DISCARD ALL (or a server switched under the client): prepared again.
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    third = post(client, "/api/orders/", basket("p-3"), key="p-3")
    assert third.status_code == 201
    assert post(client, "/api/orders/", basket("p-3"), key="p-3").content == third.content
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'idempotent%%'")
        assert cursor.fetchone()[0] == 3
    assert IdempotencyKey.objects.filter(state=KeyState.COMPLETED).count() == 3
    # Already prepared on the server (a pooler handed over a used connection).
    from idempotent_orders.http import claim_sql

    prepared = claim_sql._prepared_sql[connection.alias]
    assert all(name.startswith("idempotent_orders_claim_") for name in prepared.names)
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
        cursor.execute(prepared.prepares[1])
    from idempotent_orders import prepared as sessions

    # As a connection new to the client: nothing known of its session.
    sessions._sessions[connection.connection].prepared.difference_update(prepared.names)
    fourth = post(client, "/api/orders/", basket("p-4"), key="p-4")
    assert fourth.status_code == 201
    assert post(client, "/api/orders/", basket("p-4"), key="p-4").content == fourth.content


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "setting",
    [
        # Django's setting for PgBouncer's transaction pooling, where a prepared
        # statement may live on another server connection.
        ("DISABLE_SERVER_SIDE_CURSORS", True),
        # A connection per request: preparing would cost a round trip each time.
        ("CONN_MAX_AGE", 0),
    ],
)
def test_the_claim_sends_plain_statements_for_transaction_pooling_or_short_connections(
    alice: Any, monkeypatch: pytest.MonkeyPatch, setting: tuple[str, Any]
) -> None:
    from django.test.utils import CaptureQueriesContext

    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 60)
    monkeypatch.setitem(connection.settings_dict, *setting)
    client = client_for(alice)
    connection.close()
    with CaptureQueriesContext(connection) as queries:
        first = post(client, "/api/orders/", key="plain")
        again = post(client, "/api/orders/", key="plain")
    assert (first.status_code, again["Idempotent-Replayed"]) == (201, "true")
    assert not any(q["sql"].startswith(("PREPARE", "EXECUTE")) for q in queries)


# --- anonymous callers without a session ------------------------------------------


def test_an_anonymous_key_without_a_session_is_refused_saying_how_to_get_one(
    flavour: str,
) -> None:
    # Each cookieless request was a new session principal: the same key and body
    # twice ran twice, unprotected. Now it is a 401 naming the way out.
    from django.contrib.sessions.models import Session

    for _ in range(2):
        response = post(Client(), f"/t/{flavour}counter/", key="k")
        data = problem(response, 401, "session-required")
        assert "cookie" in data["detail"]
        assert "sessionid" not in response.cookies
    assert flavour + "counter" not in http_urls.RUNS
    assert not IdempotencyKey.objects.exists()
    assert not Session.objects.exists()


def test_cookieless_page_loads_are_rate_limited_per_client_ip(settings: Any) -> None:
    # Each cookieless page load minted a session and a token, with no cap across sessions.
    settings.IDEMPOTENT_ORDERS = {"SESSION_RATE": 3, "SESSION_RATE_WINDOW": 60}
    address = f"192.0.2.{uuid.uuid4().int % 250}-{uuid.uuid4().hex[:8]}"  # fresh in the cache
    statuses = [Client(REMOTE_ADDR=address).get("/shop/").status_code for _ in range(5)]
    assert statuses == [200, 200, 200, 429, 429]
    limited = Client(REMOTE_ADDR=address).get("/shop/")
    data = problem(limited, 429, "too-many-sessions")
    assert 0 < int(limited["Retry-After"]) <= 61
    assert "session cookie" in data["detail"]
    assert IdempotencyKey.objects.filter(is_token=True).count() == 3
    # Another address is not held back, nor a visitor sending back its cookie.
    assert Client(REMOTE_ADDR=f"{address}-other").get("/shop/").status_code == 200
    returning = Client(REMOTE_ADDR=address)
    returning.cookies = Client(REMOTE_ADDR=f"{address}-first").get("/shop/").cookies
    assert returning.get("/shop/").status_code == 200
