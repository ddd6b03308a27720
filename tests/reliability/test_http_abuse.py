"""HTTP abuse: a mixed hostile load against a live server, then invariants read from the database.

Many users retry and double-submit their own orders while, at the same time,
an attacker replays their keys and tokens with its own requests, a flooder
holds more keys than its quota, and others send oversize keys and bodies,
mismatched payloads, no key or no login. The checks afterwards do not trust
the responses alone: they compare them with the orders and keys in the database.
"""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from idempotent_orders.http.tokens import issue_token
from idempotent_orders.models import IdempotencyKey, KeyState, Order
from tests.support.corpus import HTTP_BAD_BODIES
from tests.support.http import request, session_cookie

pytestmark = [pytest.mark.backends("postgresql", "mysql"), pytest.mark.services]

USERS = 6
ORDERS_PER_USER = 3
COPIES = 3
QUOTA = 15
FLOOD = QUOTA + 15
MAX_BYTES = 8192
THREADS = 16

#: What each kind of request may get back; every non-2xx must be problem+json with this code.
EXPECTED: dict[str, dict[int, str | None]] = {
    "legit": {201: None, 200: None, 409: "key-in-flight"},
    "replay": {201: None},
    "mismatch": {422: "key-mismatch"},
    "cross": {201: None},
    "foreign-token": {403: "token-invalid"},
    "flood": {201: None, 429: "quota-exceeded"},
    "long-key": {400: "key-invalid"},
    "big-body": {413: "body-too-large"},
    "no-key": {400: "key-missing"},
    "anonymous": {401: "not-authenticated"},
    "bad-body": {400: "invalid-order"},
}


@dataclass
class Call:
    kind: str
    user: Any  # None for anonymous
    cookie: str
    key: str | None
    body: Any
    status: int = 0
    headers: dict[str, str] | None = None
    payload: Any = None

    def send(self, base: str) -> Call:
        status, headers, raw = request(
            base, "/api/orders/", cookie=self.cookie, key=self.key, body=self.body
        )
        self.status, self.headers = status, {k.lower(): v for k, v in headers.items()}
        self.payload = json.loads(raw) if raw else None
        return self


def basket(tag: str, amount: str = "10.00") -> dict[str, Any]:
    # One sku per request: distinct requests never meet on the business key.
    return {"amount": amount, "currency": "CNY", "items": [{"sku": tag, "quantity": 1}]}


@pytest.mark.django_db(transaction=True)
def test_mixed_hostile_load_keeps_every_invariant(live_server: Any, settings: Any) -> None:
    settings.IDEMPOTENT_ORDERS = {
        **getattr(settings, "IDEMPOTENT_ORDERS", {}),
        "KEY_QUOTA": QUOTA,
        "MAX_REQUEST_BYTES": MAX_BYTES,
    }
    base = live_server.url
    rng = random.Random(8)
    cookies = {f"user{i}": session_cookie(f"user{i}") for i in range(USERS)}
    cookies |= {
        name: session_cookie(name) for name in ("attacker0", "attacker1", "flooder", "prober")
    }
    users = {u.username: u for u in get_user_model().objects.all()}
    attackers, flooder = [users["attacker0"], users["attacker1"]], users["flooder"]

    def call(kind: str, name: str | None, key: str | None, body: Any) -> Call:
        return Call(kind, users.get(name or ""), cookies.get(name or "", ""), key, body)

    # Before the storm: each user's first order completes, so its key is settled.
    settled = [
        call("legit", f"user{i}", f"u{i}-first", basket(f"u{i}-first")).send(base)
        for i in range(USERS)
    ]
    assert [c.status for c in settled] == [201] * USERS, [c.payload for c in settled]
    tokens = {f"user{i}": issue_token(f"user:{users[f'user{i}'].pk}").key for i in range(USERS)}

    storm: list[Call] = []
    for i in range(USERS):
        name = f"user{i}"
        for n in range(ORDERS_PER_USER):  # retries and double submits of the same request
            storm += [call("legit", name, f"u{i}-{n}", basket(f"u{i}-{n}")) for _ in range(COPIES)]
        storm += [call("legit", name, tokens[name], basket(f"u{i}-token")) for _ in range(COPIES)]
        storm.append(call("replay", name, f"u{i}-first", basket(f"u{i}-first")))
        storm.append(call("mismatch", name, f"u{i}-first", basket(f"u{i}-first", "99.00")))
        # An attacker reuses every key and token of the user's, with its own requests.
        attacker = f"attacker{i % 2}"
        for n in range(ORDERS_PER_USER):
            storm.append(call("cross", attacker, f"u{i}-{n}", basket(f"x-u{i}-{n}")))
        storm.append(call("cross", attacker, f"u{i}-first", basket(f"x-u{i}-first")))
        storm.append(call("foreign-token", attacker, tokens[name], basket(f"x-u{i}-token")))
    storm += [call("flood", "flooder", f"f-{n}", basket(f"f-{n}")) for n in range(FLOOD)]
    storm += [call("long-key", "attacker0", "k" * 300, basket(f"lk-{n}")) for n in range(10)]
    padded = {**basket("big"), "pad": "x" * MAX_BYTES}
    storm += [call("big-body", "attacker1", f"big-{n}", padded) for n in range(10)]
    storm += [call("no-key", "attacker0", None, basket(f"nk-{n}")) for n in range(5)]
    storm += [call("anonymous", None, f"anon-{n}", basket(f"an-{n}")) for n in range(5)]
    # Deep nesting, amounts past Decimal's precision, non-ASCII digits: 400, never a 500.
    storm += [
        call("bad-body", "prober", f"bad-{case.name}", case.body)
        for case in HTTP_BAD_BODIES
        if len(case.body) <= MAX_BYTES
    ]
    rng.shuffle(storm)

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda c: c.send(base), storm))

    # 1. Every answer is one its kind allows; every error is problem+json saying so.
    for c in storm:
        allowed = EXPECTED[c.kind]
        assert c.status in allowed, (c.kind, c.key, c.status, c.payload)
        if c.status >= 400:
            assert c.headers is not None
            assert c.headers["content-type"] == "application/problem+json", c.headers
            assert (c.payload["status"], c.payload["code"]) == (c.status, allowed[c.status])
            if c.status in (409, 429):
                assert int(c.headers["retry-after"]) > 0
    # A careful client retries an in-flight answer with the same key: it gets the result.
    for c in storm:
        if c.status == 409:
            c.send(base)
            assert c.status in (200, 201), c.payload

    # 2. No answer carries someone else's order: nothing was replayed across principals.
    ok = [c for c in [*settled, *storm] if c.status in (200, 201)]
    owners = dict(Order.objects.values_list("pk", "customer_id"))
    for c in ok:
        assert owners[c.payload["id"]] == c.user.pk, (c.kind, c.key)
    for c in storm:
        if c.kind == "cross":
            assert c.headers is not None
            assert "idempotent-replayed" not in c.headers  # it ran as the attacker's own

    # 3. One order per distinct accepted (principal, key), the same one for every copy.
    by_request: dict[tuple[int, str | None], set[int]] = defaultdict(set)
    for c in ok:
        by_request[(c.user.pk, c.key)].add(c.payload["id"])
    assert all(len(ids) == 1 for ids in by_request.values()), by_request
    legit = {(c.user.pk, c.key) for c in [*settled, *storm] if c.kind in ("legit", "replay")}
    assert legit <= set(by_request)
    flooded = sum(1 for c in storm if c.kind == "flood" and c.status == 201)
    crossed = sum(1 for c in storm if c.kind == "cross")
    assert Order.objects.count() == len(legit) + crossed + flooded == len(by_request)
    per_user = Counter(Order.objects.values_list("customer_id", flat=True))
    for i in range(USERS):
        assert per_user[users[f"user{i}"].pk] == ORDERS_PER_USER + 2  # first, storm, token
    assert sum(per_user[a.pk] for a in attackers) == crossed == USERS * (ORDERS_PER_USER + 1)

    # 4. The keys: each principal holds its own row of a shared key; none is left in flight.
    for i in range(USERS):
        holders = IdempotencyKey.objects.filter(key=f"u{i}-0").values_list("principal", flat=True)
        expected = [f"user:{users[f'user{i}'].pk}", f"user:{attackers[i % 2].pk}"]
        assert sorted(holders) == sorted(expected)
        token = IdempotencyKey.objects.get(key=tokens[f"user{i}"])
        assert (token.principal, token.state) == (
            f"user:{users[f'user{i}'].pk}",
            KeyState.COMPLETED,
        )
    assert not IdempotencyKey.objects.filter(state=KeyState.IN_FLIGHT).exists()
    assert not IdempotencyKey.objects.filter(key="k" * 300).exists()
    assert not IdempotencyKey.objects.filter(key__startswith="big-").exists()

    # 5. The flood: the quota held exactly, concurrent first uses included (the
    # count and the insert are one statement, serialized per principal).
    held = IdempotencyKey.objects.filter(principal=f"user:{flooder.pk}").count()
    assert held == flooded
    assert flooded == QUOTA, flooded
    assert sum(1 for c in storm if c.kind == "flood" and c.status == 429) == FLOOD - flooded
