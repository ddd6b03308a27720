"""A claimed key's lease: when it is live, how it is renewed while the view runs.

A claim holds its key for ``KEY_LEASE`` seconds. While the view runs, one
shared heartbeat thread renews the lease once a third of it has passed (fast
views cost no renewal), so a slow view is never run twice; a crashed one is
taken over once its lease expires (:mod:`idempotent_orders.http.claims`). A live
lease keeps the key from expiring (``KEY_TTL``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import connection, models
from django.db.models.functions import Greatest
from django.utils import timezone

from idempotent_orders.conf import conf
from idempotent_orders.models import IdempotencyKey, KeyState

__all__ = ["KeyClaim", "alive", "heartbeat", "lease_live", "lease_values", "renew"]

logger = logging.getLogger("idempotent_orders")


@dataclass
class KeyClaim:
    """A key this request holds: its row and the lease owner that fences its writes.

    The holder (:mod:`idempotent_orders.http.claims` took the key) runs the view and
    stores the response; its lease is renewed by :func:`heartbeat`.
    """

    row: IdempotencyKey
    owner: str


def alive(now: Any) -> models.Q:
    """Rows not yet expired: before ``expires_at``, or in flight with a live lease."""
    return models.Q(expires_at__gt=now) | models.Q(
        state=KeyState.IN_FLIGHT, lease_expires_at__gt=now
    )


def lease_live(row: IdempotencyKey, now: Any) -> bool:
    return (
        row.state == KeyState.IN_FLIGHT
        and row.lease_expires_at is not None
        and row.lease_expires_at > now
    )


def lease_values(lease: Any) -> dict[str, Any]:
    """A lease ending at ``lease`` and an expiry no earlier: ``KEY_TTL`` never ends a live lease."""
    return {
        "lease_expires_at": lease,
        "expires_at": Greatest(
            "expires_at", models.Value(lease, output_field=models.DateTimeField())
        ),
    }


class _Beater:
    """One shared thread renewing the leases of claims whose view runs long.

    A claim is registered when its view starts and renewed only once a third
    of the lease has passed, so a fast request costs no thread and no query;
    the thread (with its own connection) is started on first use and idles
    on a condition while nothing is due.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.due: dict[int, tuple[KeyClaim, float]] = {}
        self.thread: threading.Thread | None = None
        self.next_id = 0
        #: When the thread wakes up next on its own (monotonic; inf: when notified).
        self.wake_at = float("inf")

    def add(self, held: KeyClaim) -> int:
        with self.cond:
            self.next_id += 1
            ident = self.next_id
            at = time.monotonic() + _beat_interval()
            self.due[ident] = (held, at)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="idempotency-heartbeat", daemon=True
                )
                self.thread.start()
            elif at < self.wake_at:
                # Only then: waking the thread for every request would cost each
                # one a thread switch (an idle thread wakes once per interval).
                self.cond.notify()
        return ident

    def remove(self, ident: int) -> None:
        with self.cond:
            self.due.pop(ident, None)

    def _run(self) -> None:
        while True:
            with self.cond:
                while True:
                    now = time.monotonic()
                    ready = [(i, h) for i, (h, at) in self.due.items() if at <= now]
                    if ready:
                        break
                    upcoming = [at for _h, at in self.due.values()]
                    if not upcoming:
                        connection.close()  # this thread's own; reopened when a beat is due
                    # Idle, it still wakes once per interval: a claim added meanwhile is
                    # due no earlier than that, so adding one need not wake it.
                    self.wake_at = min(upcoming) if upcoming else now + _beat_interval()
                    self.cond.wait(self.wake_at - now)
                for ident, held in ready:
                    self.due[ident] = (held, now + _beat_interval())
            for _ident, held in ready:
                try:
                    renew(held)
                except Exception:  # a missed beat only risks a takeover, never corruption
                    logger.warning("idempotency heartbeat failed", exc_info=True)


def renew(held: KeyClaim) -> None:
    """One heartbeat: extend ``held``'s lease (and its expiry with it), if it still holds it."""
    lease = timezone.now() + timedelta(seconds=conf.KEY_LEASE)
    IdempotencyKey.objects.filter(pk=held.row.pk, lease_owner=held.owner).update(
        **lease_values(lease)
    )


def _beat_interval() -> float:
    return max(conf.KEY_LEASE / 3, 0.05)


_beater = _Beater()


@contextmanager
def heartbeat(held: KeyClaim) -> Iterator[None]:
    """Keep ``held``'s lease alive while the block runs (renewed from a third of the lease on)."""
    ident = _beater.add(held)
    try:
        yield
    finally:
        _beater.remove(ident)
