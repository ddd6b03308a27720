"""``@idempotent``: run any function or Celery task once per message key, via the inbox."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar, overload

from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, transaction

from idempotent_orders.conf import conf
from idempotent_orders.exceptions import InvalidMessage
from idempotent_orders.models import InboxStatus, Outcome, ProcessedMessage
from idempotent_orders.signals import message_consumed

__all__ = ["idempotent", "message_key"]

P = ParamSpec("P")
R = TypeVar("R")

#: How the key is found: a field name looked up in the call's arguments, or a callable.
KeySpec = str | Callable[..., Any]


def message_key(spec: KeySpec, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """The idempotency key of one call.

    A field name is looked up as a keyword argument first, then in the first
    positional argument that is a mapping holding it (so a bound Celery task's
    ``self`` is skipped). A callable receives the call's arguments.
    """
    if callable(spec):
        value = spec(*args, **kwargs)
    elif spec in kwargs:
        value = kwargs[spec]
    else:
        found = [a[spec] for a in args if isinstance(a, Mapping) and spec in a]
        if not found:
            raise InvalidMessage(f"no {spec!r} in the arguments to take the idempotency key from")
        value = found[0]
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= conf.MAX_MESSAGE_ID_LENGTH
        or not value.isprintable()
    ):
        raise InvalidMessage(
            "the idempotency key must be a non-empty printable string of at most "
            f"{conf.MAX_MESSAGE_ID_LENGTH} characters, got {value!r:.80}"
        )
    return value


def _recorded(value: Any) -> Any:
    """The JSON form a result is stored in; first runs and duplicates both return this."""
    return json.loads(json.dumps(value, cls=DjangoJSONEncoder))


@overload
def idempotent(
    func: Callable[P, R], *, key: KeySpec, consumer: str | None = ..., using: str | None = ...
) -> Callable[P, Any]: ...
@overload
def idempotent(
    func: None = ..., *, key: KeySpec, consumer: str | None = ..., using: str | None = ...
) -> Callable[[Callable[P, R]], Callable[P, Any]]: ...
def idempotent(
    func: Callable[P, R] | None = None,
    *,
    key: KeySpec,
    consumer: str | None = None,
    using: str | None = None,
) -> Any:
    """Run the decorated function at most once per key; a repeat returns the first result.

    The inbox row (``ProcessedMessage``, unique on ``(consumer, key)``) is
    inserted in the same transaction as everything the function writes to
    ``using``: either both commit or neither does. A concurrent duplicate waits
    on the unique index until the first call commits (then returns its result)
    or rolls back (then runs itself). If the function raises, nothing is
    recorded and a retry runs it again, which is what Celery's ``acks_late``
    redelivery and ``self.retry()`` need.

    The result is stored as JSON (``DjangoJSONEncoder``) and every call gets
    that JSON form back, first run or duplicate alike, so return JSON-able
    values (a ``Decimal`` comes back as a string).

    Only database effects are covered. Calling another system (e-mail,
    webhook, payment provider) from inside is at-least-once: a crash after the
    call but before the commit repeats it.

    ``consumer`` names the inbox (default: the function's dotted path); keep it
    stable across deploys, or old keys stop matching.
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, Any]:
        name = consumer or f"{fn.__module__}.{fn.__qualname__}"
        if len(name) > 64:
            raise ValueError(f"consumer name {name!r} is longer than 64 characters")

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            message_id = message_key(key, args, kwargs)
            with transaction.atomic(using=using):
                try:
                    with transaction.atomic(using=using):
                        row = ProcessedMessage.objects.using(using).create(
                            consumer=name,
                            message_id=message_id,
                            status=InboxStatus.PROCESSING,
                        )
                except IntegrityError:
                    first = (
                        ProcessedMessage.objects.using(using)
                        .filter(consumer=name, message_id=message_id)
                        .values_list("result", flat=True)
                        .first()
                    )
                    outcome, result = Outcome.DUPLICATE, first
                else:
                    result = _recorded(fn(*args, **kwargs))
                    row.status, row.outcome, row.result = (
                        InboxStatus.DONE,
                        Outcome.APPLIED,
                        result,
                    )
                    row.save(update_fields=["status", "outcome", "result", "updated_at"])
                    outcome = Outcome.APPLIED
                # Sent once the caller's outer transaction (if any) has committed too.
                transaction.on_commit(
                    functools.partial(
                        message_consumed.send,
                        sender=ProcessedMessage,
                        consumer=name,
                        message_id=message_id,
                        message_type="",
                        order_id=None,
                        outcome=outcome,
                        reason="already processed" if outcome is Outcome.DUPLICATE else "",
                    ),
                    using=using,
                )
            return result

        wrapper.consumer = name  # type: ignore[attr-defined]
        return wrapper

    return decorate if func is None else decorate(func)
