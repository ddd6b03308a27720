"""The consume road: one message, or a batch, applied to its order exactly once.

One module per step, in the order a message meets them, each importing only
the ones above it (``tests/test_structure.py`` keeps it so):

1. :mod:`~idempotent_orders.consuming.graph`: the model's django-fsm-2 graph.
2. :mod:`~idempotent_orders.consuming.registry`: message types and the
   transitions they drive.
3. :mod:`~idempotent_orders.consuming.envelope`: a raw message becomes an
   envelope, or a reason.
4. :mod:`~idempotent_orders.consuming.running`: running the model's own
   transition and committing it with one conditional UPDATE.
5. :mod:`~idempotent_orders.consuming.decision`: what the message does to the
   order as read.
6. :mod:`~idempotent_orders.consuming.prepared`: hot statements straight to the
   driver, prepared once per database session.
7. :mod:`~idempotent_orders.consuming.arrays`: PostgreSQL array literals of a
   batch's columns.
8. :mod:`~idempotent_orders.consuming.sql`: the per-vendor statements (the
   order read, the inbox insert, the claim-and-apply statement).
9. :mod:`~idempotent_orders.consuming.payments`: a payment pays one order, once.
10. :mod:`~idempotent_orders.consuming.failures`: what raised is kept, retried,
    dead-lettered.
11. :mod:`~idempotent_orders.consuming.savepoints`: a batch message's savepoint,
    taken at its first statement.
12. :mod:`~idempotent_orders.consuming.one_statement`: PostgreSQL's one-statement
    road for transitions with nothing of the project's to run.
13. :mod:`~idempotent_orders.consuming.one_transaction`: MariaDB's and SQLite's road
    for a decided message: its writes sent as one transaction of their own.
14. :mod:`~idempotent_orders.consuming.update_many`: a batch chunk's one UPDATE of
    many orders written as SQL on MariaDB and SQLite.
15. :mod:`~idempotent_orders.consuming.writing`: the read-decide-write road's
    transaction (claim, run the transition, the conditional UPDATE, park).
16. :mod:`~idempotent_orders.consuming.claim_and_run`: PostgreSQL's road for
    transitions that run the project's code: two round trips.
17. :mod:`~idempotent_orders.consuming.single`: ``consume_message``.
18. :mod:`~idempotent_orders.consuming.chunk`: a batch chunk's claim, order lock
    and one UPDATE.
19. :mod:`~idempotent_orders.consuming.batch`: ``consume_batch``.
20. :mod:`~idempotent_orders.consuming.aio`: ``aconsume_message`` and
    ``aconsume_batch``, the road from async code (a worker thread per message).

The dedup layers in
front of the database are :mod:`idempotent_orders.dedup`.
"""

#: The modules of the road, lowest first: each imports only modules before it.
LAYERS = (
    "graph",
    "rules",
    "registry",
    "envelope",
    "running",
    "decision",
    "backends",
    "backends.postgresql",
    "backends.postgresql_arrays",
    "backends.mysql",
    "backends.sqlite",
    "prepared",
    "sql",
    "payments",
    "failures",
    "savepoints",
    "one_statement",
    "one_transaction",
    "update_many",
    "writing",
    "claim_and_run",
    "single",
    "chunk",
    "batch",
    "aio",
)

#: The road's public names, importable from here: ``from idempotent_orders.consuming
#: import consume_message``. Looked up on first use, so importing the package loads
#: nothing else (the app registry need not be ready).
_PUBLIC = {
    "consume_message": "single",
    "release_parked": "single",
    "redeliver": "single",
    "consume_batch": "batch",
    "aconsume_message": "aio",
    "aconsume_batch": "aio",
    "register": "registry",
    "MessageFailed": "failures",
    "apply_transition": "running",
    "current_message": "envelope",
}

__all__ = ["LAYERS", *_PUBLIC]


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
