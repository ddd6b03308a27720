"""Consume the consumer tasks' Celery messages in batches, acknowledged only after commit.

The producers keep sending ``idempotent_orders.consume_payment`` and
``idempotent_orders.consume_shipping`` task messages (``publish``, the outbox
relay); :class:`BatchWorker` reads them from the same queue with a plain kombu
consumer instead of a Celery worker, and hands each batch to
:func:`~idempotent_orders.consuming.batch.consume_batch`:

1. it takes up to ``batch_size`` deliveries (prefetch is twice that), or what
   arrived within ``flush_interval`` seconds of the first;
2. it decodes each task message; a message that cannot be decoded, or whose
   arguments are not one message, goes into the batch as it is, so
   ``consume_batch`` records it ``rejected`` with its reason;
3. ``consume_batch`` commits, then every delivery of the batch is acknowledged.

A worker killed before step 3 acknowledged nothing: the broker redelivers the
whole batch and the inbox answers ``duplicate`` for what had committed.
A database error requeues the batch after a backoff. A delivery for a task the
worker does not consume is rejected without requeue (the queue's dead-letter
exchange keeps it, if it has one) and logged.

Run it with ``manage.py consume_orders_in_batches --queue Q``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from django.db import close_old_connections, connection

from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.models import Outcome
from idempotent_orders.tasks import TRANSIENT_ERRORS

__all__ = ["CONSUMERS", "BatchWorker", "Delivery", "decode"]

logger = logging.getLogger("idempotent_orders")

#: Task name -> consumer: the tasks whose messages the batch worker takes.
CONSUMERS: dict[str, str] = {
    "idempotent_orders.consume_payment": "payments",
    "idempotent_orders.consume_shipping": "shipping",
}


@dataclass
class Delivery:
    """One broker delivery, decoded: its consumer and the message its task would receive."""

    consumer: str | None
    message: Any
    #: Why the delivery is not a well-formed task message ("" when it is).
    problem: str = ""


def decode(headers: Mapping[str, Any] | None, body: Any) -> Delivery:
    """Read a Celery task message (protocol 2, or 1) the way the consumer task would.

    Never raises. ``consumer`` is ``None`` for a task this worker does not
    consume; a malformed body comes back as ``message`` for the inbox to reject.
    """
    headers = headers or {}
    task = headers.get("task")
    if task is None and isinstance(body, Mapping):  # protocol 1: everything in the body
        task = body.get("task")
        args: Any = body.get("args")
    elif isinstance(body, (list, tuple)) and body:  # protocol 2: (args, kwargs, embed)
        args = body[0]
        kwargs = body[1] if len(body) > 1 else {}
        if not args and isinstance(kwargs, Mapping) and "message" in kwargs:
            args = [kwargs["message"]]
    else:
        args = None
    consumer = CONSUMERS.get(task) if isinstance(task, str) else None
    if isinstance(args, (list, tuple)) and len(args) == 1:
        return Delivery(consumer, args[0])
    return Delivery(consumer, body, problem="the task arguments are not one message")


@dataclass
class _Pending:
    kombu_message: Any
    delivery: Delivery


@dataclass
class BatchWorker:
    """The consuming loop: ``BatchWorker(connection, queue).run()`` until :meth:`stop`."""

    connection: Any  # kombu.Connection
    queue: Any  # kombu.Queue
    batch_size: int = 200
    flush_interval: float = 0.5
    heartbeat_file: Path | None = None
    #: Seconds to wait before requeueing a batch that hit a database error (doubles, capped).
    backoff: float = 0.5
    backoff_max: float = 30.0
    #: Counters: messages acknowledged, batches committed and requeued, deliveries dead-lettered.
    stats: dict[str, int] = field(
        default_factory=lambda: {"acked": 0, "batches": 0, "requeued": 0, "unrouted": 0}
    )
    _pending: list[_Pending] = field(default_factory=list)
    _stopping: bool = False
    _failures: int = 0

    def stop(self, *_: Any) -> None:
        """Finish (commit and acknowledge) the batch at hand, then return from :meth:`run`."""
        self._stopping = True

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop()

    def run(self) -> None:
        from kombu import Consumer

        channel = self.connection.channel()
        channel.basic_qos(prefetch_size=0, prefetch_count=self.batch_size * 2, a_global=False)
        consumer = Consumer(
            channel,
            queues=[self.queue],
            callbacks=[self._receive],
            on_decode_error=self._undecodable,
            accept=["json"],
            auto_declare=True,
        )
        consumer.consume()
        first_at: float | None = None
        try:
            while not self._stopping:
                self._beat()
                timeout = self.flush_interval
                if first_at is not None:
                    timeout = max(0.0, first_at + self.flush_interval - time.monotonic())
                # At most a second: a stop signal is noticed within one.
                with contextlib.suppress(TimeoutError):
                    self.connection.drain_events(timeout=min(max(timeout, 0.001), 1.0))
                if self._pending and first_at is None:
                    first_at = time.monotonic()
                due = first_at is not None and time.monotonic() >= first_at + self.flush_interval
                if len(self._pending) >= self.batch_size or (self._pending and due):
                    self.flush()
                    first_at = None
            if self._pending:
                self.flush()
        finally:
            try:
                consumer.cancel()
            finally:
                channel.close()

    def _receive(self, body: Any, message: Any) -> None:
        self._pending.append(_Pending(message, decode(message.headers, body)))

    def _undecodable(self, message: Any, exc: Exception) -> None:
        raw = message.body
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        consumer = CONSUMERS.get((message.headers or {}).get("task", ""))
        self._pending.append(
            _Pending(message, Delivery(consumer, text, problem=f"undecodable body: {exc}"))
        )

    def _beat(self) -> None:
        if self.heartbeat_file is not None:
            self.heartbeat_file.write_text(f"{time.time():.3f}\n")

    def flush(self) -> None:
        """Consume the pending deliveries, then acknowledge them (requeue on a database error)."""
        pending, self._pending = self._pending, []
        by_consumer: dict[str, list[_Pending]] = {}
        for p in pending:
            if p.delivery.consumer is None:
                logger.error(
                    "batch worker: delivery %s is not for a consumer task (%r): dead-lettered",
                    (p.kombu_message.headers or {}).get("id"),
                    (p.kombu_message.headers or {}).get("task"),
                )
                p.kombu_message.reject(requeue=False)
                self.stats["unrouted"] += 1
                continue
            if p.delivery.problem:
                logger.warning("batch worker: malformed delivery: %s", p.delivery.problem)
            by_consumer.setdefault(p.delivery.consumer, []).append(p)
        close_old_connections()
        try:
            for consumer, items in by_consumer.items():
                outcomes = consume_batch([p.delivery.message for p in items], consumer=consumer)
                self._record(outcomes)
        except TRANSIENT_ERRORS as exc:
            self._requeue(pending, by_consumer, exc)
            return
        for items in by_consumer.values():
            for p in items:
                p.kombu_message.ack()
            self.stats["acked"] += len(items)
        self.stats["batches"] += 1
        self._failures = 0

    def _record(self, outcomes: Sequence[Outcome]) -> None:
        pass  # a hook for subclasses that count outcomes; consume_batch already sends signals

    def _requeue(
        self, pending: list[_Pending], by_consumer: dict[str, list[_Pending]], exc: BaseException
    ) -> None:
        # A part may have committed: its messages come back as duplicates.
        self._failures += 1
        wait = min(self.backoff_max, self.backoff * 2 ** (self._failures - 1))
        logger.warning(
            "batch worker: database error on a batch of %d, requeued in %.1fs: %r",
            len(pending),
            wait,
            exc,
        )
        with contextlib.suppress(Exception):  # the connection may already be gone
            connection.close()
        time.sleep(wait)
        for items in by_consumer.values():
            for p in items:
                p.kombu_message.requeue()
        self.stats["requeued"] += 1
