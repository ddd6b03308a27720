"""Live-server HTTP helpers: a logged-in session cookie, a careful POST, requests sent at once."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from django.contrib.auth import get_user_model
from django.test import Client

#: A small valid order body for the test URLconf's create-order views.
ORDER = {"amount": "12.50", "currency": "CNY", "items": [{"sku": "tea", "quantity": 1}]}


def session_cookie(username: str) -> str:
    user = get_user_model().objects.create_user(username, password="pw")
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}"


def request(
    base: str, path: str, *, cookie: str, key: str | None, body: Any = ORDER
) -> tuple[int, dict[str, str], bytes]:
    """POST like a careful client: a connection dropped by the test server's small
    listen backlog is retried with the same key, which is what keys are for."""
    parts = urlsplit(base)
    headers = {"Content-Type": "application/json", "Cookie": cookie}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    if key is not None:
        headers["Idempotency-Key"] = key
    for attempt in range(10):
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        try:
            conn.request("POST", path, body=raw, headers=headers)
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        except ConnectionError:
            if attempt == 9:
                raise
            time.sleep(0.05 * (attempt + 1))
        finally:
            conn.close()
    raise AssertionError("unreachable")


def together(n: int, call: Callable[[int], Any]) -> list[Any]:
    """Run ``call(i)`` in ``n`` threads released at the same instant."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = call(i)
        except Exception as exc:  # reported by the assertion below
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def assert_one_execution(results: list[Any], order_pk: Any, copies: int) -> Any:
    """Identical keyed requests fired together: one original, the rest replays or 409.

    Every answer is the original's order or a ``key-in-flight`` problem with
    ``Retry-After``. Returns the original's (status, headers, body).
    """
    assert not [r for r in results if isinstance(r, Exception)], results
    originals = [r for r in results if r[0] == 201 and "Idempotent-Replayed" not in r[1]]
    replays = [r for r in results if r[0] == 201 and r[1].get("Idempotent-Replayed") == "true"]
    conflicts = [r for r in results if r[0] == 409]
    print(
        f"{copies} identical: {len(originals)} original, {len(replays)} replayed, "
        f"{len(conflicts)} in flight (409)"
    )
    assert len(originals) == 1
    assert len(originals) + len(replays) + len(conflicts) == copies, [r[0] for r in results]
    for _status, _headers, body in originals + replays:
        assert json.loads(body)["id"] == order_pk
    for _status, headers, body in conflicts:
        assert headers["Content-Type"] == "application/problem+json"
        assert headers["Retry-After"] == "1"
        assert json.loads(body)["code"] == "key-in-flight"
    return originals[0]
