"""A testing kit for projects that consume messages with idempotent_orders.

Deliver each message many times in shuffled order (one by one, in batches, from
threads, from an event loop), crash a delivery at a named point as a dying worker
would, and assert the exactly-once guarantee on your own order model::

    from idempotent_orders.testing import (
        assert_exactly_once, crash_at, deliver, shuffled_copies, watch_effects,
    )

The pytest plugin (:mod:`idempotent_orders.testing.plugin`, registered as the
``idempotent_orders`` entry point) adds the ``exactly_once`` fixture: the same
functions, with a random generator seeded from the test's id.

The database cannot show an e-mail sent twice or a payment captured twice:
:func:`watch_effects` counts a project's effects outside it per business event
(:mod:`idempotent_orders.testing.effects`).

Importing this package loads nothing else: the names are looked up on first use,
after Django is set up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see; at run time the names load on first use
    from idempotent_orders.testing.kit import (
        CRASH_POINTS,
        Delivery,
        Effect,
        EffectBeforeCommit,
        Effects,
        ExactlyOnce,
        WorkerDied,
        assert_exactly_once,
        crash_at,
        deliver,
        deliver_from_event_loop,
        deliver_from_threads,
        deliver_in_batches,
        shuffled_copies,
        watch_effects,
    )

__all__ = [
    "CRASH_POINTS",
    "Delivery",
    "Effect",
    "EffectBeforeCommit",
    "Effects",
    "ExactlyOnce",
    "WorkerDied",
    "assert_exactly_once",
    "crash_at",
    "deliver",
    "deliver_from_event_loop",
    "deliver_from_threads",
    "deliver_in_batches",
    "shuffled_copies",
    "watch_effects",
]

_PUBLIC = frozenset(__all__)


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from idempotent_orders.testing import kit

    return getattr(kit, name)
