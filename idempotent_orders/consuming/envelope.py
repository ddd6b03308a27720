"""The first step of the road: a raw message becomes an :class:`Envelope`, or a clear reason.

:func:`parse_envelope` checks size, id, type (against the registry), order id,
``seq`` and payload, and never raises anything but
:class:`~idempotent_orders.exceptions.InvalidMessage` with a readable reason.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from idempotent_orders.conf import conf
from idempotent_orders.consuming.registry import MessageHandler, get_handler
from idempotent_orders.exceptions import InvalidMessage

__all__ = [
    "BODY_EXCERPT",
    "ConsumedMessage",
    "Envelope",
    "consuming",
    "current_message",
    "has_nul",
    "parse_envelope",
    "serialise",
    "synthetic_id",
    "valid_message_id",
]

#: Stored excerpt of a rejected message's raw body.
BODY_EXCERPT = 4096

# ``json.dumps`` with options builds an encoder per call; these are built once
# (an encoder keeps no state between calls).
#: What :attr:`Envelope.fingerprint` hashes.
_FINGERPRINT = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=repr
)
#: What :func:`parse_envelope` measures: ``json.dumps(message, ensure_ascii=False)``.
_SIZE = json.JSONEncoder(ensure_ascii=False)


@dataclass(frozen=True)
class Envelope:
    """A validated message envelope."""

    message_id: str
    message_type: str
    order_id: int
    seq: int | None
    payload: dict[str, Any]
    handler: MessageHandler

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 of what the message says (type, order, seq, payload), not of its id."""
        text = _FINGERPRINT.encode([self.message_type, self.order_id, self.seq, self.payload])
        return hashlib.sha256(text.encode("ascii")).hexdigest()

    def inbox_fields(self, consumer: str) -> dict[str, Any]:
        """The inbox columns this message fills in for ``consumer``, as the roads that write
        the inbox row as SQL of their own take them."""
        return {
            "consumer": consumer,
            "message_id": self.message_id,
            "message_type": self.message_type,
            "order_id": self.order_id,
            "seq": self.seq,
            "fingerprint": self.fingerprint,
        }

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "message_id": self.message_id,
            "type": self.message_type,
            "order_id": self.order_id,
            "payload": self.payload,
        }
        if self.seq is not None:
            data["seq"] = self.seq
        return data


def has_nul(value: Any, depth: int = 0) -> bool:
    """Whether a NUL character hides anywhere in ``value`` (no database column stores one)."""
    if depth > 32:
        return False  # the size/serialisation check rejects absurd nesting
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, Mapping):
        return any(has_nul(k, depth + 1) or has_nul(v, depth + 1) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(has_nul(v, depth + 1) for v in value)
    return False


def valid_message_id(value: Any) -> bool:
    """Whether ``value`` can be a message id: a short printable string."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= conf.MAX_MESSAGE_ID_LENGTH
        and value.strip() == value
        and value.isprintable()
    )


def serialise(message: Any) -> str:
    """The message as escaped JSON text (no NUL bytes, no lone surrogates)."""
    try:
        return json.dumps(message, ensure_ascii=True, sort_keys=True, default=repr)
    except (TypeError, ValueError, RecursionError):
        try:
            text = repr(message)[:BODY_EXCERPT]
        except RecursionError:  # absurd nesting defeats repr() too
            text = f"<{type(message).__name__} nested too deeply to show>"
        return json.dumps(text, ensure_ascii=True)


def parse_envelope(message: Any, *, consumer: str | None = None) -> Envelope:
    """Validate a raw message; raise :class:`InvalidMessage` with a readable reason.

    With ``consumer``, a type restricted to other consumers is rejected too.
    """
    if not isinstance(message, Mapping):
        raise InvalidMessage(f"message must be a JSON object, got {type(message).__name__}")
    try:
        text = _SIZE.encode(message)
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        # A lone surrogate (JSON allows "\ud800") cannot be stored in any database column.
        raise InvalidMessage("message contains an unpaired UTF-16 surrogate") from None
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidMessage(f"message is not JSON-serialisable: {str(exc)[:120]}") from None
    if size > conf.MAX_MESSAGE_BYTES:
        raise InvalidMessage(f"message is {size} bytes, the limit is {conf.MAX_MESSAGE_BYTES}")
    message_id = message.get("message_id")
    if not valid_message_id(message_id):
        raise InvalidMessage(
            "message_id must be a non-empty printable string of at most "
            f"{conf.MAX_MESSAGE_ID_LENGTH} characters without surrounding spaces"
        )
    # JSON writes a NUL as \u0000, so text without that sequence has none to look for.
    if "\\u0000" in text and has_nul(message):
        raise InvalidMessage("message contains a NUL character")
    message_type = message.get("type")
    if not isinstance(message_type, str):
        raise InvalidMessage("type must be a string")
    handler = get_handler(message_type)
    if handler is None:
        raise InvalidMessage(f"unknown message type {message_type[:64]!r}")
    if handler.consumers and consumer is not None and consumer not in handler.consumers:
        raise InvalidMessage(
            f"message type {message_type!r} is not accepted by the {consumer[:64]!r} consumer"
        )
    order_id = message.get("order_id")
    if isinstance(order_id, str) and order_id.isdigit() and len(order_id) < 19:
        order_id = int(order_id)
    if not isinstance(order_id, int) or isinstance(order_id, bool) or order_id <= 0:
        raise InvalidMessage("order_id must be a positive integer")
    seq = message.get("seq")
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool) or seq <= 0):
        raise InvalidMessage("seq must be a positive integer when present")
    if seq is not None and seq > 2**31 - 1:
        raise InvalidMessage("seq is too large")
    payload = message.get("payload", {})
    if not isinstance(payload, dict):
        raise InvalidMessage(f"payload must be a JSON object, got {type(payload).__name__}")
    return Envelope(
        message_id=str(message_id),
        message_type=message_type,
        order_id=order_id,
        seq=seq,
        payload=payload,
        handler=handler,
    )


def synthetic_id(message: Any) -> str:
    """A stable inbox id for a message whose own id is unusable, so copies dedup too."""
    digest = hashlib.sha256(serialise(message).encode("ascii")).hexdigest()
    return f"invalid:{digest}"


@dataclass(frozen=True)
class ConsumedMessage:
    """The message being consumed, as :func:`current_message` shows it to the project's code."""

    message_id: str
    message_type: str
    order_id: int
    seq: int | None
    payload: Mapping[str, Any]
    consumer: str


_current: contextvars.ContextVar[tuple[Envelope, str] | None] = contextvars.ContextVar(
    "idempotent_orders_current_message", default=None
)


def current_message() -> ConsumedMessage | None:
    """The message whose transition is running now: its id, type, order, seq, payload
    and consumer; None outside a consume.

    For the project's code that runs while a message is applied: a transition body or
    condition, a receiver of ``pre_transition``/``post_transition``/``pre_save``/
    ``post_save``, a ``save()`` override. It is what the message says, for reading: a
    receiver of a ``shipment.dispatched`` whose transition takes no arguments reads the
    tracking number here. It is set for each attempt of a message (a lost race runs
    the transition again), never across messages.
    """
    held = _current.get()
    if held is None:
        return None
    envelope, consumer = held
    return ConsumedMessage(
        message_id=envelope.message_id,
        message_type=envelope.message_type,
        order_id=envelope.order_id,
        seq=envelope.seq,
        payload=MappingProxyType(envelope.payload),
        consumer=consumer,
    )


@contextlib.contextmanager
def consuming(envelope: Envelope, consumer: str) -> Iterator[None]:
    """Make ``envelope`` the :func:`current_message` for the code run inside (what it
    shows is built only when asked)."""
    token = _current.set((envelope, consumer))
    try:
        yield
    finally:
        _current.reset(token)
