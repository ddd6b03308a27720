"""Sections 3 and 4 (HTTP): the order endpoint with and without Idempotency-Key handling, peers.

Requests go through Django's in-process WSGI stack (``django.test.Client``: URL
resolving, middleware, the view, the response), no sockets, so the figures are
the server-side cost per request. Authentication is a bench middleware that
sets ``request.user`` (no session queries). Each variant gets its own client
whose middleware list holds only what that variant needs.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from bench.common import RUNS, Row, fmt, median, na, setup

N = int(os.environ.get("BENCH_HTTP_REQUESTS", "300"))
CONCURRENT = int(os.environ.get("BENCH_HTTP_CONCURRENT", "50"))
BASE_MIDDLEWARE = ["bench.http.BenchUserMiddleware"]
PEER_MIDDLEWARE = {
    "django-idempotency-key": ["idempotency_key.middleware.ExemptIdempotencyKeyMiddleware"]
}


class BenchUserMiddleware:
    """Sets ``request.user`` to the bench user: authentication without session queries."""

    user: Any = None

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        request.user = BenchUserMiddleware.user
        return self.get_response(request)


def _client(variant: str) -> Any:
    from django.test import Client, override_settings

    client = Client()
    with override_settings(MIDDLEWARE=BASE_MIDDLEWARE + PEER_MIDDLEWARE.get(variant, [])):
        client.handler.load_middleware()
    return client


def _order(i: int, tag: str) -> str:
    return json.dumps(
        {"amount": "12.50", "currency": "CNY", "items": [{"sku": f"{tag}-{i}", "quantity": 1}]}
    )


def _timed(client: Any, url: str, tag: str, keyed: bool) -> list[float]:
    """Per-request seconds of N order creations, each a new basket (and key)."""
    times = []
    for i in range(N):
        headers = {"Idempotency-Key": f"{tag}-{i}"} if keyed else {}
        start = time.perf_counter()
        response = client.post(
            url, _order(i, tag), content_type="application/json", headers=headers
        )
        times.append(time.perf_counter() - start)
        if response.status_code != 201:
            raise RuntimeError(f"{url}: {response.status_code} {response.content[:200]!r}")
    return times


def _concurrent(variant: str) -> tuple[int, dict[int, int]]:
    """Orders created by CONCURRENT identical requests (same key, same body) at once."""
    from django.db import connections

    from idempotent_orders.models import Order

    tag = f"conc-{variant}-{uuid.uuid4().hex[:8]}"
    body = json.dumps({"tag": tag, "amount": "12.50", "currency": "CNY"})
    clients = [_client(variant) for _ in range(CONCURRENT)]
    barrier = threading.Barrier(CONCURRENT)
    statuses: dict[int, int] = {}
    lock = threading.Lock()

    def fire(client: Any) -> None:
        try:
            barrier.wait()
            r = client.post(
                f"/bench/{variant}/plain/",
                body,
                content_type="application/json",
                headers={"Idempotency-Key": tag},
            )
            with lock:
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        finally:
            connections.close_all()

    threads = [threading.Thread(target=fire, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Order.objects.filter(business_key__startswith=f"{tag}-").count(), statuses


def run() -> list[Row]:
    setup()
    from django.contrib.auth import get_user_model
    from django.db import connection

    connection.ensure_connection()
    BenchUserMiddleware.user = get_user_model().objects.create(
        username=f"bench-{uuid.uuid4().hex[:8]}"
    )
    clients = {v: _client(v) for v in ("none", "ours", "django-idempotency-key", "drf-idempotency")}
    per_request: dict[str, list[float]] = {v: [] for v in clients}
    rates: dict[str, list[float]] = {v: [] for v in clients}
    token_rates: list[float] = []
    for run_no in range(RUNS):
        # Alternate the variants within each run so drift of the machine hits all alike.
        for variant, client in clients.items():
            tag = f"h{run_no}-{variant}-{uuid.uuid4().hex[:6]}"
            # A fresh caller per run: the live-key quota check counts the caller's keys.
            BenchUserMiddleware.user = get_user_model().objects.create(username=tag)
            url = "/api/orders/" if variant == "ours" else f"/bench/{variant}/orders/"
            times = _timed(client, url, tag, keyed=variant != "none")
            per_request[variant].append(median(times))
            rates[variant].append(N / sum(times))
        start = time.perf_counter()
        for _ in range(N):
            r = clients["none"].post(
                "/api/idempotency-tokens/", "{}", content_type="application/json"
            )
            if r.status_code != 201:
                raise RuntimeError(f"token endpoint: {r.status_code} {r.content[:200]!r}")
        token_rates.append(N / (time.perf_counter() - start))

    base_ms = median(per_request["none"]) * 1000
    rows = [
        Row(
            "3 http (in-process WSGI)",
            "POST /api/orders/ without the decorator (same body)",
            fmt(median(rates["none"])),
            f"median {base_ms:.2f} ms/request",
        ),
    ]
    for variant, label in (
        ("ours", "with @idempotent"),
        ("django-idempotency-key", "django-idempotency-key"),
        ("drf-idempotency", "drf-idempotency"),
    ):
        ms = median(per_request[variant]) * 1000
        note = f"median {ms:.2f} ms/request, +{ms - base_ms:.2f} ms"
        if variant == "ours":
            note += " over undecorated (target <= 0.5 ms)"
        rows.append(
            Row(
                "3 http (in-process WSGI)" if variant == "ours" else "4 peers: http",
                f"POST orders, {label}",
                fmt(median(rates[variant])),
                note,
            )
        )
    rows.append(
        Row(
            "3 http (in-process WSGI)",
            "POST /api/idempotency-tokens/",
            fmt(median(token_rates)),
            "one-time token issued per request",
        )
    )
    for variant in ("none", "ours", "django-idempotency-key", "drf-idempotency"):
        try:
            created, statuses = _concurrent(variant)
        except Exception as exc:  # a peer failing must not hide the others
            rows.append(
                na(
                    "4 peers: http",
                    f"{variant}: {CONCURRENT} concurrent identical requests",
                    repr(exc)[:80],
                )
            )
            continue
        codes = ", ".join(f"{n}x{c}" for c, n in sorted(statuses.items()))
        rows.append(
            Row(
                "4 peers: http",
                f"{variant}: {CONCURRENT} concurrent identical requests",
                f"{created} order{'s' if created != 1 else ''}",
                f"non-deduplicating body; responses {codes}",
            )
        )
    return rows


if __name__ == "__main__":
    from bench.common import print_table

    print_table(run())
