"""Round trips to PostgreSQL counted from libpq's protocol trace of this thread's connection."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from django.db import connection


@contextmanager
def round_trips(texts: list[str] | None = None) -> Iterator[Callable[[], int]]:
    """Counts what the client sends to be answered (libpq's protocol trace: each ``Query``
    or ``Sync`` is one round trip) on this thread's connection; ``texts`` receives the
    simple protocol's texts, as sent."""
    connection.ensure_connection()
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
