"""Round trips counted on this thread's connection: PostgreSQL's from libpq's protocol trace,
MariaDB's from what mysqlclient's connection sends."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

from django.db import connection


@contextmanager
def round_trips(texts: list[str] | None = None) -> Iterator[Callable[[], int]]:
    """Counts what the client sends to be answered (libpq's protocol trace: each ``Query``
    or ``Sync`` is one round trip) on this thread's connection; ``texts`` receives the
    simple protocol's texts, as sent."""
    connection.ensure_connection()
    if connection.vendor == "mysql":
        with _mysql_round_trips(texts) as count:
            yield count
        return
    pgconn = connection.connection.pgconn
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)

        def count() -> int:
            with open(path, encoding="utf-8", errors="replace") as trace:
                sent = [
                    parts
                    for line in trace
                    if len(parts := line.split("\t")) > 3
                    and parts[1] == "F"
                    and parts[3] in ("Query", "Sync")
                ]
            if texts is not None:
                texts[:] = [parts[4].strip() for parts in sent if parts[3] == "Query"]
            return len(sent)

        pgconn.trace(fd)
        try:
            yield count
        finally:
            pgconn.untrace()
            os.close(fd)


@contextmanager
def _mysql_round_trips(texts: list[str] | None) -> Iterator[Callable[[], int]]:
    """MariaDB: each text mysqlclient's connection sends (``query``), each ``COMMIT``/
    ``ROLLBACK`` it sends itself and each change of the session's autocommit is one round
    trip (what the connection's own attributes stand in for is not sent)."""
    from MySQLdb import _mysql
    from MySQLdb.connections import Connection

    raw = connection.connection
    sent: list[str] = []

    def query(self: Any, text: Any) -> Any:
        if self is raw:
            sent.append(text.decode() if isinstance(text, bytes) else str(text))
        return _mysql.connection.query(self, text)

    def autocommit(self: Any, on: bool) -> None:
        if bool(on) != self.get_autocommit():
            if self is raw:
                sent.append(f"SET autocommit={int(bool(on))}")
            _mysql.connection.autocommit(self, bool(on))

    def commit(self: Any) -> None:
        if self is raw:
            sent.append("COMMIT")
        _mysql.connection.commit(self)

    def rollback(self: Any) -> None:
        if self is raw:
            sent.append("ROLLBACK")
        _mysql.connection.rollback(self)

    def count() -> int:
        if texts is not None:
            texts[:] = sent
        return len(sent)

    with (
        mock.patch.object(Connection, "query", query),
        mock.patch.object(Connection, "autocommit", autocommit),
        mock.patch.object(Connection, "commit", commit),
        mock.patch.object(Connection, "rollback", rollback),
    ):
        yield count
