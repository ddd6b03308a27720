"""Advisory fast path in front of the inbox's unique index.

``seen()`` may answer "duplicate" without a database query; ``remember()`` is
called after a message's transaction commits. Neither is ever the authority:
a wrong "not seen" only costs a database round trip.

The Bloom filter and Redis layers are not wired in yet: until they are, every
message goes to the database.
"""

from __future__ import annotations


def seen(consumer: str, message_id: str) -> bool:
    """True only when a message is known, for certain, to have been processed."""
    return False


def remember(consumer: str, message_id: str) -> None:
    """Record a processed message in the fast layers (called after commit)."""
