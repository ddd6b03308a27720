"""The in-process publisher: a daemon thread that publishes rows right after their commit.

:class:`Publisher` takes the ids :func:`~idempotent_orders.outbox.publish_on_commit`
hands it after commit and publishes them in batches, through the relay's own
paths (:mod:`~idempotent_orders.outbox.relay`); :data:`publisher` is the
process's one instance, :func:`flush_publisher` waits for it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque

from django.db import close_old_connections, connections

from idempotent_orders.conf import conf
from idempotent_orders.outbox import relay, sender

logger = logging.getLogger("idempotent_orders")


class Publisher:
    """A daemon thread that publishes committed outbox rows for this process.

    Producers hand it row ids after commit (:meth:`submit`: an append, and a
    wake-up only when the thread is idle; never blocking). When ids keep
    coming, the thread waits :attr:`linger` seconds for more, so that one batch publishes
    them all (not when it was idle: a lone id is published at once), then
    locks, publishes and marks them as the relay does (rows
    without an order key through :func:`_publish_unkeyed`, one prepared
    statement each to lock and to mark; keyed rows through
    :func:`relay_outbox`, which keeps their order). Its queue is bounded
    (:attr:`capacity`): a row that does not fit is left to the relay. It is
    started on first use in each process (again after a fork, with an empty
    queue) and flushed at interpreter exit for up to :attr:`exit_timeout`
    seconds; rows it did not reach are still pending, for the relay.
    """

    capacity = 10_000
    exit_timeout = 5.0
    #: Seconds the thread waits, once woken, for more ids to publish them as one batch.
    linger = 0.05
    #: Seconds without work after which the thread closes its database connection.
    idle_close = 1.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        #: (database, row id, whether the row has an order key), in submission order.
        self._pending: deque[tuple[str, int, bool]] = deque()
        #: Set when there is work (or the stop) for an idle thread.
        self._wake = threading.Event()
        #: True from before the thread takes ids until their batch is done.
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._exit_hook = False

    def submit(self, db: str, pk: int, keyed: bool = False) -> bool:
        """Queue row ``pk`` of database ``db``; False when the queue is full.

        ``keyed``: the row has an ``order_key`` (it is published by the path
        that keeps a key's order).
        """
        thread = self._thread
        if thread is None or not thread.is_alive() or self._pid != os.getpid():
            self._ensure_started()
        pending = self._pending
        if len(pending) >= self.capacity:
            return False
        pending.append((db, pk, keyed))
        if not self._wake.is_set():
            self._wake.set()
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted row was handled; False on timeout."""
        deadline = time.monotonic() + timeout
        # Ids leave the queue only after _busy is set: an empty queue, then not busy,
        # means the batch that took the last of them is done.
        while self._pending or self._busy:
            if time.monotonic() >= deadline or not self._alive():
                return False
            time.sleep(0.005)
        return True

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._pid == os.getpid()

    def _ensure_started(self) -> None:
        if self._alive():
            return
        with self._lock:
            if self._alive():
                return
            if self._pid != os.getpid():  # a forked child: the parent's ids are not ours
                self._pending = deque()
                self._wake = threading.Event()
                self._busy = False
            self._pid = os.getpid()
            self._stopping = False
            self._thread = threading.Thread(
                target=self._run, name="idempotent-orders-outbox", daemon=True
            )
            self._thread.start()
            if not self._exit_hook:
                atexit.register(self._stop)
                self._exit_hook = True

    def _stop(self) -> None:
        if self._alive():
            self.flush(self.exit_timeout)
            self._stopping = True
            self._wake.set()
            assert self._thread is not None
            self._thread.join(self.exit_timeout)

    def _run(self) -> None:
        sender._batch.templates = {}  # this thread's batches reuse their message templates a moment
        sender._batch.keep = True  # and one producer while ids keep coming
        pending, wake = self._pending, self._wake
        idle = True  # the last round found nothing to do
        finished = float("-inf")  # when the last batch was done (monotonic)
        try:
            while not self._stopping:
                if not pending:
                    idle = True
                    wake.clear()
                    if not pending:  # checked again after the clear: no wake-up is lost
                        if not wake.wait(self.idle_close):
                            connections.close_all()  # idle: hold no database connection
                        continue
                size = conf.OUTBOX_BATCH_SIZE
                # Woken from idle, the first ids go at once (no added latency for a lone
                # message); ids that came while a batch was publishing, or less than
                # ``linger`` after the last batch (a steady stream: one message after
                # another), mean more are coming: wait a moment, and one batch takes them all.
                streaming = not idle or time.monotonic() - finished < self.linger
                if streaming and len(pending) < size and not self._stopping:
                    time.sleep(self.linger)
                idle = False
                self._busy = True
                try:
                    batch = [pending.popleft() for _ in range(min(size, len(pending)))]
                    if not self._publish(batch) or not pending:
                        sender._release_kept()  # after a failure, or idle: back to the pool
                finally:
                    self._busy = False
                    finished = time.monotonic()
        finally:
            sender._release_kept()
            connections.close_all()

    def _publish(self, batch: list[tuple[str, int, bool]]) -> bool:
        """Publish ``batch``; False when any publish in it failed."""
        by_db: dict[str, tuple[list[int], list[int]]] = {}
        for db, pk, has_key in batch:
            by_db.setdefault(db, ([], []))[has_key].append(pk)
        close_old_connections()
        ok = True
        for db, (plain, keyed) in by_db.items():
            try:
                results = []
                if plain:
                    results.append(relay._publish_unkeyed(db, plain))
                if keyed:
                    results.append(relay.relay_outbox(ids=keyed, using=db))
                ok = ok and not any(r.retried or r.dead for r in results)
            except Exception:
                ok = False
                logger.exception(
                    "outbox: background publish of %d row(s) failed; the relay will retry",
                    len(plain) + len(keyed),
                )
        return ok


#: The process's background publisher (see ``OUTBOX_PUBLISHER_THREAD``).
publisher = Publisher()


def flush_publisher(timeout: float = 10.0) -> bool:
    """Wait until the background publisher handled every row handed to it; False on timeout.

    For scripts and tests that want the immediate publishes done before they go on.
    """
    return publisher.flush(timeout)
