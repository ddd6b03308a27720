"""Sections 3 and 4 (HTTP peers): written against the DESIGN contract; n/a until that code exists."""

from __future__ import annotations

import importlib.util

from bench.common import Row, na


def run() -> list[Row]:
    rows: list[Row] = []
    if importlib.util.find_spec("idempotent_orders.http") is None:
        reason = "idempotent_orders.http is not in this tree yet"
        rows += [
            na("3 http", "order create, with/without Idempotency-Key decorator", reason),
            na("3 http", "token endpoint", reason),
        ]
    else:
        rows.append(na("3 http", "order create / token endpoint", "measurement not written yet"))
    for peer, module in (
        ("django-idempotency-key", "idempotency_key"),
        ("drf-idempotency", "drf_idempotency"),
    ):
        installed = importlib.util.find_spec(module) is not None
        rows.append(
            na(
                "4 peers: http",
                f"{peer}: req/s, dups of 50 concurrent identical requests",
                "needs the orders endpoint (idempotent_orders.http)"
                if installed
                else f"{peer} not installed (pip install -e '.[bench]')",
            )
        )
    return rows
