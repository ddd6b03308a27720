"""A testing kit for projects that consume messages with idempotent_orders.

Deliver each message many times in shuffled order (one by one, in batches, from
threads, from an event loop), crash a delivery at a named point as a dying worker
would, and assert the exactly-once guarantee on your own order model::

    from idempotent_orders.testing import assert_exactly_once, crash_at, deliver, shuffled_copies

The pytest plugin (:mod:`idempotent_orders.testing.plugin`, registered as the
``idempotent_orders`` entry point) adds the ``exactly_once`` fixture: the same
functions, with a random generator seeded from the test's id.

Importing this package loads nothing else: the names are looked up on first use,
after Django is set up.
"""

from __future__ import annotations

_PUBLIC = (
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
)

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from idempotent_orders.testing import kit

    return getattr(kit, name)
