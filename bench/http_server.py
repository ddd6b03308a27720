"""Section 3b (HTTP on a real server): gunicorn with sync workers, load from ``wrk``.

The bench urlconf's order view is served by gunicorn (``BENCH_HTTP_WORKERS`` sync
workers, 3) and loaded by ``wrk`` (``BENCH_HTTP_CONNECTIONS`` connections, 8, for
``BENCH_HTTP_SECONDS`` each, 4) in interleaved rounds: undecorated, ``@idempotent``
with a new key per request, ``@idempotent`` replays (each request repeats one of
``BENCH_HTTP_REPLAY_KEYS`` keys already answered), and the same two for each peer;
on the default stack also a view answering a made-up order with no work at all
behind the same outer layers, the ceiling no replay can pass there.
Every request of a "new" round carries a new basket, so each creates an order.
Rates count answered (2xx) requests only; the others are reported beside them.

Two servers run side by side, their rounds interleaved: the default one has the
demo's middleware stack (sessions, CSRF, authentication, messages) and the
caller logged in by its session cookie; the ``NON-DEFAULT (header auth)`` one
names the caller by a header and has no session middleware (undecorated and
``@idempotent`` only). A fresh caller per round keeps the live-key quota count
small alike for every variant.
"""

from __future__ import annotations

import importlib.util
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
from typing import Any

from bench.common import ROOT, RUNS, Row, fmt, median, na, setup

#: A checkout of other code (``BENCH_HTTP_BEFORE``, e.g. the previous release): a third
#: server runs it on the default stack, its rounds interleaved with this code's.
BEFORE = os.environ.get("BENCH_HTTP_BEFORE", "")
#: The server stacks: the demo's (sessions), the header-named caller (NON-DEFAULT), and
#: the other checkout's code on the demo's stack if there is one.
STACKS = ("session", "header", *(("before",) if BEFORE else ()))
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
    "canned": "/bench/canned/orders/",
}

#: wrk script: a new key and a new basket per request ("new"), or the same requests
#: as the warm-up answered, round robin ("replay").
LUA = r"""
local counter = 0
local threads = 0
local mode, path, user, tag, keys = "%(mode)s", "%(path)s", "%(user)s", "%(tag)s", %(keys)d
local cookie = "%(cookie)s"
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
  if cookie ~= "" then headers["Cookie"] = cookie end
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


def _start_server(port: int, stack: str) -> subprocess.Popen[bytes]:
    root = BEFORE if stack == "before" else str(ROOT)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "BENCH_HTTP_SERVER": "1",
        "BENCH_HTTP_AUTH": "header" if stack == "header" else "session",
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
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
        cwd=root,
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


def _caller(stack: str, tag: str) -> tuple[int, str]:
    """A new user, and the Cookie header of its logged-in session (none for ``header``)."""
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.test import Client

    user = get_user_model().objects.create(username=tag)
    if stack == "header":
        return user.pk, ""
    client = Client()
    client.force_login(user)
    name = settings.SESSION_COOKIE_NAME
    return user.pk, f"{name}={client.cookies[name].value}"


def _post(port: int, path: str, user: int, cookie: str, key: str) -> int:
    body = json.dumps(
        {"amount": "12.50", "currency": "CNY", "items": [{"sku": key, "quantity": 1}]},
        separators=(", ", ": "),
    ).encode()
    headers = {
        "Content-Type": "application/json",
        "X-Bench-User": str(user),
        "Idempotency-Key": key,
    }
    if cookie:
        headers["Cookie"] = cookie
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _wrk(
    port: int, mode: str, path: str, user: int, cookie: str, tag: str
) -> tuple[float, int, int]:
    """Requests/s, requests and non-2xx responses of one wrk run."""
    script = LUA % {
        "mode": mode,
        "path": path,
        "user": user,
        "cookie": cookie,
        "tag": tag,
        "keys": REPLAY_KEYS,
    }
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


def _plan() -> list[tuple[str, str, str]]:
    """(stack, variant, mode) of one round: the default stack first, then the header one."""
    plan = [("session", "none", "none"), ("session", "canned", "none")]
    plan += [
        ("session", variant, mode)
        for variant in ("ours", "django-idempotency-key", "drf-idempotency")
        for mode in ("new", "replay")
    ]
    plan += [("header", "none", "none"), ("header", "ours", "new"), ("header", "ours", "replay")]
    if BEFORE:
        plan += [("before", "ours", "new"), ("before", "ours", "replay")]
    return plan


def run() -> list[Row]:
    if shutil.which("wrk") is None:
        return [na(SECTION, "real-server HTTP", "wrk not installed (apt-get install wrk)")]
    if importlib.util.find_spec("gunicorn") is None:
        return [na(SECTION, "real-server HTTP", "gunicorn not installed (the bench extra)")]
    setup()
    from django.db import connection

    connection.ensure_connection()
    servers: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
    rates: dict[str, list[float]] = {}
    failed: dict[str, int] = {}
    try:
        for stack in STACKS:
            port = _free_port()
            servers[stack] = (port, _start_server(port, stack))
        for run_no in range(RUNS + 1):  # round 0 warms every worker and is not counted
            for stack, variant, mode in _plan():
                port = servers[stack][0]
                tag = f"w{run_no}-{stack[:1]}-{variant[:4]}-{mode}-{uuid.uuid4().hex[:6]}"
                user, cookie = _caller(stack, tag)
                path = URLS[variant]
                if mode == "replay":  # answer each replayed request once first
                    codes = {
                        _post(port, path, user, cookie, f"{tag}-{k}") for k in range(REPLAY_KEYS)
                    }
                    if codes - {200, 201}:
                        raise RuntimeError(f"{stack} {variant}: first answers {sorted(codes)}")
                rate, total, bad = _wrk(port, mode, path, user, cookie, tag)
                if run_no:  # only answered (2xx) requests count
                    key = f"{stack}/{variant}/{mode}"
                    ok = rate * (total - bad) / total if total else 0.0
                    rates.setdefault(key, []).append(ok)
                    failed[key] = failed.get(key, 0) + bad
    finally:
        for _port, server in servers.values():
            server.send_signal(signal.SIGTERM)
        for _port, server in servers.values():
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
    return _rows(rates, failed)


def _rows(rates: dict[str, list[float]], failed: dict[str, int]) -> list[Row]:
    setup_note = f"{WORKERS} sync workers, wrk {CONNECTIONS} conns x {SECONDS}s"
    targets = {"new": "target >= 90%", "replay": "target >= 150%"}
    rows = []
    labels = {
        "session": "session auth, the demo's middleware",
        "header": "NON-DEFAULT (header auth, no session middleware)",
        "before": f"session auth, the code of {BEFORE}",
    }
    for stack in STACKS:
        label = labels[stack]
        # The other checkout is compared with this code's undecorated view.
        base = median(rates[f"{'session' if stack == 'before' else stack}/none/none"])
        if stack != "before":
            bad = failed[f"{stack}/none/none"]
            rows.append(
                Row(
                    SECTION,
                    f"POST orders, undecorated (new basket each); {label}",
                    fmt(base),
                    setup_note + (f"; {bad} non-2xx" if bad else ""),
                )
            )
        canned = rates.get(f"{stack}/canned/none")
        if canned:
            rows.append(
                Row(
                    SECTION,
                    f"POST orders, a made-up answer, no work (a replay's ceiling); {label}",
                    fmt(median(canned)),
                    f"{median(canned) / base:.0%} of undecorated: the server, the middleware"
                    " and the caller's authentication alone",
                )
            )
        for variant in ("ours", "django-idempotency-key", "drf-idempotency"):
            name = "@idempotent" if variant == "ours" else variant
            for mode in ("new", "replay"):
                key = f"{stack}/{variant}/{mode}"
                if key not in rates:
                    continue
                value = median(rates[key])
                note = f"{value / base:.0%} of undecorated"
                if variant == "ours":
                    note += f" ({targets[mode]})"
                if failed[key]:
                    note += f"; {failed[key]} non-2xx or socket errors (not counted)"
                rows.append(
                    Row(
                        SECTION,
                        f"POST orders, {name}, {'new key' if mode == 'new' else 'replay'};"
                        f" {'session auth' if stack == 'session' else label}",
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
