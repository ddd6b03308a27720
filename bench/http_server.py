"""Section 3b (HTTP on a real server): gunicorn with sync workers, load from ``wrk``.

The bench urlconf's order view is served by gunicorn (``BENCH_HTTP_WORKERS`` sync
workers, 3) and loaded by ``wrk`` (``BENCH_HTTP_CONNECTIONS`` connections, 8, for
``BENCH_HTTP_SECONDS`` each, 4) in interleaved rounds: undecorated, ``@idempotent``
with a new key per request, ``@idempotent`` replays (each request repeats one of
``BENCH_HTTP_REPLAY_KEYS`` keys already answered), and the same two for each peer.
Every request of a "new" round carries a new basket, so each creates an order.
Rates count answered (2xx) requests only; the others are reported beside them.
The caller is named by a header; a fresh caller per round keeps the live-key
quota count small alike for every variant.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from bench.common import ROOT, RUNS, Row, fmt, median, na, setup

WORKERS = int(os.environ.get("BENCH_HTTP_WORKERS", "3"))
CONNECTIONS = int(os.environ.get("BENCH_HTTP_CONNECTIONS", "8"))
SECONDS = int(os.environ.get("BENCH_HTTP_SECONDS", "4"))
REPLAY_KEYS = int(os.environ.get("BENCH_HTTP_REPLAY_KEYS", "64"))
SECTION = "3b http (gunicorn + wrk)"
URLS = {
    "none": "/bench/none/orders/",
    "ours": "/api/orders/",
    "django-idempotency-key": "/bench/django-idempotency-key/orders/",
    "drf-idempotency": "/bench/drf-idempotency/orders/",
}

#: wrk script: a new key and a new basket per request ("new"), or the same requests
#: as the warm-up answered, round robin ("replay").
LUA = r"""
local counter = 0
local threads = 0
local mode, path, user, tag, keys = "%(mode)s", "%(path)s", "%(user)s", "%(tag)s", %(keys)d
setup = function(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
local function body(id)
  return '{"amount": "12.50", "currency": "CNY", "items": [{"sku": "' .. id .. '", "quantity": 1}]}'
end
request = function()
  counter = counter + 1
  local id
  if mode == "replay" then
    id = tag .. "-" .. ((counter * 7 + (tid or 1)) %% keys)
  else
    id = tag .. "-" .. (tid or 1) .. "-" .. counter
  end
  local headers = {["Content-Type"] = "application/json", ["X-Bench-User"] = user}
  if mode ~= "none" then headers["Idempotency-Key"] = id end
  return wrk.format("POST", path, headers, body(id))
end
"""


class HeaderUserMiddleware:
    """Sets ``request.user`` to the user whose id is in ``X-Bench-User`` (cached per process)."""

    users: dict[str, Any] = {}

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        from django.contrib.auth import get_user_model
        from django.contrib.auth.models import AnonymousUser

        uid = request.headers.get("X-Bench-User", "")
        user = self.users.get(uid)
        if user is None:
            user = get_user_model().objects.filter(pk=uid).first() if uid.isdigit() else None
            user = user or AnonymousUser()
            if uid.isdigit():
                self.users[uid] = user
        request.user = user
        return self.get_response(request)


def _free_port() -> int:
    from tests.support.services import free_port

    return free_port()


def _start_server(port: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "BENCH_HTTP_SERVER": "1",
        "PYTHONPATH": str(ROOT),
    }
    gunicorn = Path(sys.executable).with_name("gunicorn")
    proc = subprocess.Popen(
        [
            str(gunicorn),
            "--workers",
            str(WORKERS),
            "--worker-class",
            "sync",
            "--bind",
            f"127.0.0.1:{port}",
            "--log-level",
            "warning",
            "--backlog",
            "256",
            "bench.wsgi:application",
        ],
        env=env,
        cwd=str(ROOT),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/bench/none/orders/", timeout=2)
        except urllib.error.HTTPError:
            return proc  # 405 for GET: the server answers
        except OSError:
            if proc.poll() is not None:
                error = proc.stderr.read()[-400:] if proc.stderr else b""
                raise RuntimeError(f"gunicorn exited: {error!r}") from None
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("gunicorn did not answer within 30 s")


def _post(port: int, path: str, user: int, key: str) -> int:
    body = json.dumps(
        {"amount": "12.50", "currency": "CNY", "items": [{"sku": key, "quantity": 1}]},
        separators=(", ", ": "),
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "X-Bench-User": str(user),
            "Idempotency-Key": key,
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _wrk(port: int, mode: str, path: str, user: int, tag: str) -> tuple[float, int, int]:
    """Requests/s, requests and non-2xx responses of one wrk run."""
    script = LUA % {"mode": mode, "path": path, "user": user, "tag": tag, "keys": REPLAY_KEYS}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    try:
        out = subprocess.run(
            [
                "wrk",
                "-t2",
                f"-c{CONNECTIONS}",
                f"-d{SECONDS}s",
                "--timeout",
                "10s",
                "-s",
                f.name,
                f"http://127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=SECONDS + 60,
            check=True,
        ).stdout
    finally:
        os.unlink(f.name)
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    failed = int(bad.group(1)) if bad else 0
    if errors:
        failed += sum(int(g) for g in errors.groups())
    return rate, total, failed


def run() -> list[Row]:
    if shutil.which("wrk") is None:
        return [na(SECTION, "real-server HTTP", "wrk not installed (apt-get install wrk)")]
    if not Path(sys.executable).with_name("gunicorn").exists():
        return [na(SECTION, "real-server HTTP", "gunicorn not installed (the bench extra)")]
    setup()
    from django.contrib.auth import get_user_model
    from django.db import connection

    connection.ensure_connection()
    port = _free_port()
    server = _start_server(port)
    rates: dict[str, list[float]] = {}
    failed: dict[str, int] = {}
    try:
        plan = [("none", "none")] + [
            (variant, mode)
            for variant in ("ours", "django-idempotency-key", "drf-idempotency")
            for mode in ("new", "replay")
        ]
        for run_no in range(RUNS + 1):  # round 0 warms every worker and is not counted
            for variant, mode in plan:
                tag = f"w{run_no}-{variant[:4]}-{mode}-{uuid.uuid4().hex[:6]}"
                user = get_user_model().objects.create(username=tag).pk
                path = URLS[variant]
                if mode == "replay":  # answer each replayed request once first
                    codes = {_post(port, path, user, f"{tag}-{k}") for k in range(REPLAY_KEYS)}
                    if codes - {200, 201}:
                        raise RuntimeError(f"{variant}: first answers {sorted(codes)}")
                rate, total, bad = _wrk(port, mode, path, user, tag)
                if run_no:  # only answered (2xx) requests count
                    ok = rate * (total - bad) / total if total else 0.0
                    rates.setdefault(f"{variant}/{mode}", []).append(ok)
                    failed[f"{variant}/{mode}"] = failed.get(f"{variant}/{mode}", 0) + bad
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
    base = median(rates["none/none"])
    setup_note = f"{WORKERS} sync workers, wrk {CONNECTIONS} conns x {SECONDS}s"
    rows = [
        Row(
            SECTION,
            "POST orders, undecorated (new basket each)",
            fmt(base),
            setup_note + (f"; {failed['none/none']} non-2xx" if failed["none/none"] else ""),
        )
    ]
    targets = {"new": "target >= 90%", "replay": "target >= 150%"}
    for variant in ("ours", "django-idempotency-key", "drf-idempotency"):
        label = "@idempotent" if variant == "ours" else variant
        for mode in ("new", "replay"):
            key = f"{variant}/{mode}"
            value = median(rates[key])
            note = f"{value / base:.0%} of undecorated"
            if variant == "ours":
                note += f" ({targets[mode]})"
            if failed[key]:
                note += f"; {failed[key]} non-2xx or socket errors (not counted)"
            rows.append(
                Row(
                    SECTION,
                    f"POST orders, {label}, {'new key' if mode == 'new' else 'replay'}",
                    fmt(value),
                    note,
                    figure=value,
                    baseline=base,
                    baseline_what="undecorated",
                )
            )
    return rows


if __name__ == "__main__":
    from bench.common import print_table

    print_table(run())
