"""The consume road: one message, or a batch, applied to its order exactly once.

One module per step, in the order a message meets them, each importing only
the ones above it (``tests/project/test_structure.py`` keeps it so); what differs between
databases is a backend (:mod:`~idempotent_orders.consuming.backends`), chosen once
per connection. ``docs/architecture.md`` says what each module holds.

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
    "backends.sqlite",
    "sql",
    "payments",
    "backends.postgresql.arrays",
    "backends.postgresql",
    "failures",
    "savepoints",
    "held",
    "unread",
    "backends.postgresql.one_statement",
    "backends.at_once",
    "writing",
    "backends.postgresql.texts",
    "backends.mysql",
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
