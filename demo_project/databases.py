"""Database settings from URLs, shared by the demo and the test settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit


def database_from_url(url: str) -> dict[str, Any]:
    """``postgres://user:pass@host:port/name``, ``mysql://...`` or ``sqlite:///path``."""
    parts = urlsplit(url)
    options = dict(parse_qsl(parts.query))
    if parts.scheme == "sqlite":
        return sqlite_database(Path(unquote(parts.path)[1:]))
    engine = {
        "postgres": "django.db.backends.postgresql",
        "postgresql": "django.db.backends.postgresql",
        "mysql": "django.db.backends.mysql",
        "mariadb": "django.db.backends.mysql",
    }[parts.scheme]
    db: dict[str, Any] = {
        "ENGINE": engine,
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        "OPTIONS": options,
        "CONN_MAX_AGE": 60,
        "CONN_HEALTH_CHECKS": True,
    }
    if engine.endswith("mysql"):
        # READ COMMITTED: re-reads after a lost optimistic race must see the winner.
        db["OPTIONS"] = {"charset": "utf8mb4", "isolation_level": "read committed", **options}
    return db


def sqlite_database(path: Path | str) -> dict[str, Any]:
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(path),
        "OPTIONS": {
            # Writers queue on the lock instead of failing; IMMEDIATE takes the
            # write lock at BEGIN so two workers never deadlock on an upgrade.
            "timeout": 30,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        },
    }
