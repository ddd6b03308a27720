"""Where an HTTP key's time goes: ``python -m bench.http_profile [--session] [--replay] [--cprofile]``.

Posts ``BENCH_HTTP_PROFILE_REQUESTS`` (400) new orders in process (``django.test.Client``,
the bench urlconf, PostgreSQL), alternating the undecorated view and
``POST /api/orders/`` with a new key, and prints for each: the median wall time per
request, each step's time per request (the decorator's steps timed by wrapping the
functions that do them), and the statements and round trips per request (libpq's
protocol trace: every ``Query`` or ``Sync`` the client sends is one round trip),
with the statements a new key sends listed by kind. ``--cprofile`` adds cProfile's
top functions of the keyed requests. CPU per request is counted on both sides:
this process's clock, and the database backend's from ``/proc`` (Linux, a local
server), the cost a real server's throughput is bound by on a busy machine.

``--session``: the demo's middleware stack (sessions, CSRF, authentication,
messages), each round's caller logged in by its session cookie, as section 3b's
default rows; without it the caller is set by a bench middleware (no session
queries). ``--replay``: the keyed requests repeat keys answered before the round
(not measured), so they are replays; the undecorated view still creates an order
per request, as in section 3b.
"""

from __future__ import annotations

import atexit
import cProfile
import os
import pstats
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from bench.common import median, setup

N = int(os.environ.get("BENCH_HTTP_PROFILE_REQUESTS", "400"))

#: Seconds of wall time and of this process's CPU per step, for the variant being measured.
_spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
_active: list[str] = []


def _timed(step: str, func: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _active:  # nested: counted in the outer step
            return func(*args, **kwargs)
        _active.append(step)
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return func(*args, **kwargs)
        finally:
            spent = _spent[step]
            spent[0] += time.perf_counter() - start
            spent[1] += time.process_time() - cpu
            _active.pop()

    return wrapper


def _instrument() -> None:
    from idempotent_orders.http import claims, decorators, header, lease, replay

    decorators.claim = _timed("claim (the key's one query)", claims.claim)
    decorators.store = _timed("store of the response", replay.store)
    decorators.get_principal = _timed("principal", decorators.get_principal)
    decorators.fingerprint = _timed("fingerprint and body", header.fingerprint)
    decorators.read_body = _timed("fingerprint and body", header.read_body)
    decorators.heartbeat = _timed("heartbeat (enter)", lease.heartbeat)
    decorators._announce = _timed("signal", decorators._announce)
    decorators.replay = _timed("replay (response rebuilt)", replay.replay)
    decorators._atomic_requests = _timed("atomic (enter)", decorators._atomic_requests)


def _trace(tmp: str) -> Callable[[], list[str]]:
    """libpq's trace of every new connection; returns the messages the client sent."""
    from django.db.backends.signals import connection_created

    paths: list[str] = []

    def traced(sender: Any, connection: Any, **kwargs: Any) -> None:
        path = os.path.join(tmp, f"trace-{len(paths)}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        connection.connection.pgconn.trace(fd)
        paths.append(path)

    connection_created.connect(traced, weak=False)

    def sent() -> list[str]:
        out = []
        for path in paths:
            with open(path, encoding="utf-8", errors="replace") as trace:
                for line in trace:
                    parts = line.rstrip("\n").split("\t")
                    if len(parts) > 3 and parts[1] == "F" and parts[3] in ("Query", "Sync"):
                        out.append(parts[3] + " " + " ".join(parts[4:])[:160])
            open(path, "w").close()
        return out

    return sent


def _backend_cpu() -> Callable[[], float]:
    """Seconds of CPU the default connection's backend has used so far (0 if unreadable)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    ticks = os.sysconf("SC_CLK_TCK")

    def used() -> float:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / ticks

    return used


def _kind(message: str) -> str:
    text = message.split(" ", 2)[-1].strip().strip('"').lstrip("'\"")
    text = re.sub(r"^\d+\s+\"?", "", text)
    words = text.replace('"', "").split()
    if not words:
        return message[:40]
    head = words[0].upper()
    if head in {"EXECUTE", "PREPARE"}:
        return f"{head} {words[1].split('_')[3] if len(words) > 1 else ''}"
    if head in {"SAVEPOINT", "RELEASE"}:
        return head + " SAVEPOINT"
    if head == "WITH":
        return "WITH ... (CTE)"
    return " ".join(words[:3])[:50]


def _session_client() -> Any:
    """A client whose handler runs the demo's middleware stack (section 3b's default)."""
    from django.test import Client, override_settings

    from demo_project.settings import MIDDLEWARE

    client = Client()
    with override_settings(MIDDLEWARE=MIDDLEWARE):
        client.handler.load_middleware()
    return client


def run(cprofile: bool, session: bool = False, replay: bool = False, verbose: bool = False) -> None:
    setup()
    from django.contrib.auth import get_user_model
    from django.db import connection, connections

    from bench.http import BenchUserMiddleware, _client, _order

    connection.ensure_connection()
    tmp = tempfile.mkdtemp(prefix="http-profile-")
    atexit.register(shutil.rmtree, tmp, True)  # the traces, however the run ends
    sent = _trace(tmp)
    connections.close_all()
    connection.ensure_connection()
    _instrument()
    backend = _backend_cpu()
    clients = {v: _session_client() if session else _client(v) for v in ("none", "ours")}
    urls = {"none": "/bench/none/orders/", "ours": "/api/orders/"}
    times: dict[str, list[float]] = {v: [] for v in clients}
    cpu: dict[str, list[tuple[float, float]]] = {v: [] for v in clients}
    steps: dict[str, dict[str, list[float]]] = {v: {} for v in clients}
    trips: dict[str, Counter[str]] = {v: Counter() for v in clients}
    examples: dict[str, dict[str, str]] = {}
    profiler = cProfile.Profile(time.process_time) if cprofile else None
    sent()
    rounds = 4
    for round_no in range(rounds):
        for variant, client in clients.items():
            tag = f"p{round_no}-{variant}-{uuid.uuid4().hex[:6]}"
            user = get_user_model().objects.create(username=tag)
            if session:
                client.force_login(user)
            else:
                BenchUserMiddleware.user = user
            keyed = variant == "ours"
            if keyed and replay:  # each key answered once first, so the round replays
                for i in range(N // rounds):
                    client.post(
                        urls[variant],
                        _order(i, tag),
                        content_type="application/json",
                        headers={"Idempotency-Key": f"{tag}-{i}"},
                    )
            sent()
            _spent.clear()
            cpu_start = (time.process_time(), backend())
            for i in range(N // rounds):
                headers = {"Idempotency-Key": f"{tag}-{i}"} if keyed else {}
                if profiler and variant == "ours":
                    profiler.enable()
                start = time.perf_counter()
                response = client.post(
                    urls[variant], _order(i, tag), content_type="application/json", headers=headers
                )
                times[variant].append(time.perf_counter() - start)
                if profiler and variant == "ours":
                    profiler.disable()
                if keyed and replay and response.get("Idempotent-Replayed") != "true":
                    raise RuntimeError(f"not a replay: {response.status_code}")
                if response.status_code != 201:
                    raise RuntimeError(f"{variant}: {response.status_code} {response.content!r}")
            cpu[variant].append(
                (
                    (time.process_time() - cpu_start[0]) / (N // rounds),
                    (backend() - cpu_start[1]) / (N // rounds),
                )
            )
            for step, (seconds, cpu_seconds) in _spent.items():
                steps[variant].setdefault(step, []).append(seconds / (N // rounds))
                steps[variant].setdefault(f"{step} CPU", []).append(cpu_seconds / (N // rounds))
            messages = sent()
            trips[variant].update(_kind(m) for m in messages)
            for message in messages:
                examples.setdefault(variant, {}).setdefault(_kind(message), message)
    per = N // rounds * rounds
    base = median(times["none"]) * 1000
    base_cpu = [median([c[side] for c in cpu["none"]]) * 1e6 for side in (0, 1)]
    for variant in clients:
        ms = median(times[variant]) * 1000
        total = sum(trips[variant].values()) / per
        mine, theirs = (median([c[side] for c in cpu[variant]]) * 1e6 for side in (0, 1))
        print(
            f"\n== {variant}: median {ms:.3f} ms/request (+{ms - base:.3f} ms), "
            f"{total:.2f} round trips/request\n"
            f"   CPU/request: client {mine:.0f} us ({mine - base_cpu[0]:+.0f}),"
            f" database backend {theirs:.0f} us ({theirs - base_cpu[1]:+.0f}),"
            f" both {mine + theirs:.0f} us ({(sum(base_cpu)) / (mine + theirs):.2f}x the"
            " undecorated rate)"
        )
        for step, values in sorted(steps[variant].items(), key=lambda kv: -median(kv[1])):
            print(f"  {step:32} {median(values) * 1e6:8.0f} us/request")
        for kind, count in trips[variant].most_common():
            print(f"  trip: {kind:40} {count / per:.2f}/request")
            if verbose:
                print(f"        {examples[variant][kind][:160]}")
    if profiler:
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    run(
        "--cprofile" in sys.argv,
        session="--session" in sys.argv,
        replay="--replay" in sys.argv,
        verbose="--verbose" in sys.argv,
    )
