"""A process that hands row ids to the outbox's background publisher, for the publisher tests.

``python -m tests.support.publisher_process OUT fork|exit``: the relay calls
(``relay_outbox``, and ``_publish_unkeyed`` for rows without an order key) are
replaced by one that appends ``<pid> <ids...>`` to OUT for every batch (no
database, no broker: what is tested is which process publishes which ids).

- ``fork``: the parent's thread is held in its first batch while two more ids
  wait in its queue; the process forks; the child submits its own id and exits
  normally (its exit flush runs); then the parent's thread is let go.
- ``exit``: ids are submitted and the process exits at once, without flushing:
  the exit hook must publish them.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import django


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from idempotent_orders.outbox import relay, thread

    parent = os.getpid()
    gate = threading.Event()
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(*, ids: list[int], using: str | None = None, **kwargs: Any) -> Any:
        if mode == "fork" and os.getpid() == parent:
            gate.wait(30)
        if mode == "exit":
            time.sleep(0.2)  # a slow broker: the exit hook has to wait for it
        os.write(fd, f"{os.getpid()} {' '.join(map(str, ids))}\n".encode())
        return relay.RelayResult(published=len(ids))

    # Replaced where the thread looks them up: in the relay module.
    relay.relay_outbox = record  # type: ignore[assignment]
    relay._publish_unkeyed = lambda db, ids: record(ids=ids, using=db)  # type: ignore[assignment]
    publisher = thread.publisher
    if mode == "exit":
        for pk in range(1, 6):
            publisher.submit("default", pk)
        sys.exit(0)  # no flush: the exit hook's job

    publisher.submit("default", 1)
    # The thread took 1 (and is held in its batch); 2 and 3 wait in the queue.
    while publisher._pending:
        time.sleep(0.01)
    time.sleep(publisher.linger * 3)
    publisher.submit("default", 2)
    publisher.submit("default", 3)
    child = os.fork()
    if child == 0:
        publisher.submit("default", 100)
        sys.exit(0)  # the child's exit hook flushes its own queue, not the parent's
    _, code = os.waitpid(child, 0)
    os.write(fd, f"child-exit {os.waitstatus_to_exitcode(code)}\n".encode())
    gate.set()
    assert publisher.flush(10)


if __name__ == "__main__":
    main()
