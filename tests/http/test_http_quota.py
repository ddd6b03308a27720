"""The live-key quota: exact on every database; on PostgreSQL checked against a bound.

On PostgreSQL a claim reads the principal's :class:`KeyQuota` bound instead of
counting its keys, and counts them only when the bound is missing or has
reached ``KEY_QUOTA``. These tests hold the quota's exactness through that:
keys that have no bound yet, a bound left high by expired keys, tokens, and
the purge of stale bounds.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone

from idempotent_orders.http import claim_sql, quotas
from idempotent_orders.http.keys import forget_stale_bounds, purge_expired, scope_of
from idempotent_orders.http.tokens import issue_token
from idempotent_orders.models import IdempotencyKey, KeyQuota, KeyState
from idempotent_orders.retention import purge
from tests import http_urls

pytestmark = pytest.mark.urls("tests.http_urls")


@pytest.fixture(autouse=True)
def _reset_runs() -> None:
    http_urls.RUNS.clear()


@pytest.fixture
def alice() -> Any:
    return get_user_model().objects.create_user("alice", password="pw")


def principal_of(user: Any) -> str:
    return f"user:{user.pk}"


def post(client: Client, key: str) -> Any:
    return client.post(
        "/t/counter/",
        data=json.dumps({"n": 1}),
        content_type="application/json",
        headers={"Idempotency-Key": key},
    )


def client_for(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def live_key(principal: str, key: str) -> IdempotencyKey:
    """A completed key of ``principal`` written directly, as one from before any bound."""
    return IdempotencyKey.objects.create(
        scope=scope_of(principal, "POST", "/elsewhere/"),
        key=key,
        principal=principal,
        method="POST",
        route="/elsewhere/",
        state=KeyState.COMPLETED,
        expires_at=timezone.now() + timedelta(hours=1),
    )


# Outside a test transaction, as a request runs: the claim's one-round-trip path.
@pytest.mark.django_db(transaction=True)
def test_keys_without_a_bound_count_toward_the_quota(alice: Any, settings: Any) -> None:
    settings.IDEMPOTENT_ORDERS = {"KEY_QUOTA": 3}
    for n in range(3):
        live_key(principal_of(alice), f"old-{n}")
    client = client_for(alice)
    assert post(client, "k1").status_code == 429  # the very first claim is counted
    settings.IDEMPOTENT_ORDERS = {"KEY_QUOTA": 4}
    assert post(client, "k1").status_code == 201
    assert post(client, "k2").status_code == 429
    assert IdempotencyKey.objects.filter(principal=principal_of(alice)).count() == 4


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_each_claim_raises_the_bound_and_a_new_bound_starts_at_the_count(
    alice: Any, settings: Any
) -> None:
    settings.IDEMPOTENT_ORDERS = {"KEY_QUOTA": 10}
    live_key(principal_of(alice), "old")
    client = client_for(alice)
    assert post(client, "k1").status_code == 201
    # No bound before: the keys were counted (one), and the new key makes two.
    assert KeyQuota.objects.get(principal=principal_of(alice)).bound == 2
    assert post(client, "k2").status_code == 201
    assert post(client, "k1").status_code == 201  # a replay inserts nothing
    assert KeyQuota.objects.get(principal=principal_of(alice)).bound == 3


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_a_bound_at_the_quota_is_recounted_not_trusted(alice: Any, settings: Any) -> None:
    settings.IDEMPOTENT_ORDERS = {"KEY_QUOTA": 3}
    # Left at the quota by keys that have since expired or been released.
    KeyQuota.objects.create(principal=principal_of(alice), bound=3)
    live_key(principal_of(alice), "old")
    client = client_for(alice)
    assert post(client, "k1").status_code == 201
    assert KeyQuota.objects.get(principal=principal_of(alice)).bound == 2  # counted: 1 + 1
    assert post(client, "k2").status_code == 201
    assert post(client, "k3").status_code == 429  # the bound (3) is recounted: 3 live keys


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_the_keys_are_counted_only_when_the_bound_has_reached_the_quota(alice: Any) -> None:
    principal = principal_of(alice)
    KeyQuota.objects.create(principal=principal, bound=2)

    def counted(quota: int) -> bool:
        now = timezone.now()
        fields = {
            "scope": scope_of(principal, "POST", f"/q/{quota}/"),
            "key": "k",
            "principal": principal,
            "method": "POST",
            "route": f"/q/{quota}/",
            "fingerprint": "f",
            "state": KeyState.IN_FLIGHT,
            "lease_owner": "owner",
            "lease_expires_at": now,
            "expires_at": now + timedelta(hours=1),
        }
        values = claim_sql._claim_params(connection, fields, now)
        values["quota"] = quota
        sql, params = claim_sql._joined((claim_sql._claim_texts(connection).insert,), values)
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (ANALYZE, COSTS OFF) {sql}", params)
            plan = [line for (line,) in cursor.fetchall() if "CTE Scan on live" in line]
        assert plan, "the count is a CTE read by the guard"
        return any("never executed" not in line for line in plan)

    assert not counted(quota=1000)
    assert counted(quota=3)  # the bound was raised to 3 by the first EXPLAIN ANALYZE


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_a_token_raises_the_bound(alice: Any, settings: Any) -> None:
    settings.IDEMPOTENT_ORDERS = {"KEY_QUOTA": 3}
    client = client_for(alice)
    assert post(client, "k1").status_code == 201
    issue_token(principal_of(alice))
    issue_token(principal_of(alice))
    assert KeyQuota.objects.get(principal=principal_of(alice)).bound == 3
    assert post(client, "k2").status_code == 429  # two tokens and a key: the quota is full


@pytest.mark.django_db
def test_purge_forgets_bounds_untouched_for_the_key_ttl(settings: Any) -> None:
    settings.IDEMPOTENT_ORDERS = {"KEY_TTL": 3600}
    now = timezone.now()
    KeyQuota.objects.create(principal="user:old", bound=5)
    KeyQuota.objects.create(principal="user:new", bound=5)
    KeyQuota.objects.filter(principal="user:old").update(updated_at=now - timedelta(hours=2))
    KeyQuota.objects.filter(principal="user:new").update(updated_at=now - timedelta(minutes=30))
    assert forget_stale_bounds(now=now) == 1
    assert list(KeyQuota.objects.values_list("principal", flat=True)) == ["user:new"]
    purge_expired(now=now + timedelta(hours=1))
    assert not KeyQuota.objects.exists()
    KeyQuota.objects.create(principal="user:again", bound=1)
    purge(now=now + timedelta(hours=3))
    assert not KeyQuota.objects.exists()


@pytest.mark.backends("postgresql")
@pytest.mark.django_db(transaction=True)
def test_a_token_is_issued_under_the_principals_claim_lock(alice: Any) -> None:
    """Concurrent claims wait for a token's issue: the bound it raises stays exact."""
    import psycopg

    principal = principal_of(alice)
    settings_dict = connection.settings_dict
    with transaction.atomic():
        issue_token(principal)
        other = psycopg.connect(
            host=settings_dict["HOST"] or None,
            port=settings_dict["PORT"] or None,
            user=settings_dict["USER"] or None,
            password=settings_dict["PASSWORD"] or None,
            dbname=settings_dict["NAME"],
            autocommit=True,
        )
        with other:
            taken = other.execute(
                "SELECT pg_try_advisory_lock(%s)", [quotas.lock_id(principal)]
            ).fetchone()
    assert taken == (False,)
