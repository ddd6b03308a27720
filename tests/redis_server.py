"""A private ``redis-server`` that a test may flush or kill (never the shared one)."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        try:
            self.proc = subprocess.Popen(
                [
                    "redis-server",
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    tempfile.gettempdir(),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except FileNotFoundError:
            from tests.conftest import IN_CI

            if IN_CI:
                pytest.fail("redis-server is not installed (CI=true: services are required)")
            pytest.skip("redis-server is not installed")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.cli("PING") == "PONG":
                    return
            except subprocess.CalledProcessError:
                pass
            time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def cli(self, *args: str) -> str:
        return subprocess.run(
            ["redis-cli", "-p", str(self.port), *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()

    def keys(self, pattern: str) -> list[str]:
        return [k for k in self.cli("--scan", "--pattern", pattern).splitlines() if k]

    def ttl(self, key: str) -> int:
        return int(self.cli("TTL", key))

    def flush(self) -> None:
        self.cli("FLUSHALL")  # our own server only

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextmanager
def private_redis_settings(url: str) -> Iterator[None]:
    """Point the dedup layer and the counters at ``url`` under the alias ``dedup``."""
    caches: dict[str, Any] = {
        **settings.CACHES,
        "dedup": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": url,
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 0.5},
        },
    }
    values = {**settings.IDEMPOTENT_ORDERS, "DEDUP_CACHE_ALIAS": "dedup"}
    with override_settings(CACHES=caches, IDEMPOTENT_ORDERS=values):
        yield
