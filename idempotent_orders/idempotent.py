"""``@idempotent``: run any function or Celery task once per message key, via the inbox.

A failed run is counted, made dead and requeued by
:mod:`idempotent_orders.idempotent_failures` (:func:`requeue_inbox` and
:func:`inbox_stats` are re-exported here, their public path); an
``external=True`` call runs as the leased step :class:`ExternalCall`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar, overload

from celery import Task, current_app
from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from idempotent_orders import leases
from idempotent_orders.conf import conf
from idempotent_orders.consuming.decision import consumed
from idempotent_orders.exceptions import (
    CallFailed,
    CallInProgress,
    InvalidMessage,
    MessageDead,
    PermanentFailure,
)
from idempotent_orders.idempotent_failures import inbox_stats, record_failure, requeue_inbox
from idempotent_orders.leases import ClaimState, Lease, LeasedStep, StepResult, Verification
from idempotent_orders.models import InboxStatus, Outcome, ProcessedMessage

__all__ = [
    "ExternalCall",
    "MessageDead",
    "PermanentFailure",
    "Verify",
    "idempotent",
    "inbox_stats",
    "load_step",
    "message_key",
    "requeue_inbox",
]

logger = logging.getLogger("idempotent_orders")

#: Asks the other system whether the effect sent with this idempotency key
#: happened: True, False, or None when it cannot tell now.
Verify = Callable[[str], "bool | None"]

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
    func: Callable[P, R],
    *,
    key: KeySpec,
    consumer: str | None = ...,
    using: str | None = ...,
    external: bool = ...,
    verify: Verify | None = ...,
    permanent: tuple[type[BaseException], ...] = ...,
    max_attempts: int | None = ...,
) -> Callable[..., Any]: ...
@overload
def idempotent(
    func: None = ...,
    *,
    key: KeySpec,
    consumer: str | None = ...,
    using: str | None = ...,
    external: bool = ...,
    verify: Verify | None = ...,
    permanent: tuple[type[BaseException], ...] = ...,
    max_attempts: int | None = ...,
) -> Callable[[Callable[P, R]], Callable[..., Any]]: ...
def idempotent(
    func: Callable[P, R] | None = None,
    *,
    key: KeySpec,
    consumer: str | None = None,
    using: str | None = None,
    external: bool = False,
    verify: Verify | None = None,
    permanent: tuple[type[BaseException], ...] = (),
    max_attempts: int | None = None,
) -> Any:
    """Run the decorated function at most once per key; a repeat returns the first result.

    The inbox row (``ProcessedMessage``, unique on ``(consumer, key)``) is
    inserted in the same transaction as everything the function writes to
    ``using``: either both commit or neither does. A concurrent duplicate waits
    on the unique index until the first call commits (then returns its result)
    or rolls back (then runs itself). If the function raises, nothing is
    recorded but the failure: the inbox row is committed (after the rollback)
    as ``processing`` with ``attempts`` and the ``error``, and the next
    delivery (Celery's ``acks_late`` redelivery, ``self.retry()``) runs it
    again. After ``max_attempts`` failed runs (default
    ``IDEMPOTENT_MAX_ATTEMPTS``), or at once when it raises
    :class:`~idempotent_orders.exceptions.PermanentFailure` or one of the
    ``permanent`` exception types, the row is **dead**: that run raises
    :class:`~idempotent_orders.exceptions.MessageDead` (chained from the
    cause), ``message_dead`` is sent, and every later delivery raises
    ``MessageDead`` without running the function, until an operator requeues
    the row (:func:`requeue_inbox`, the admin, ``manage.py requeue_idempotent``).
    ``MessageDead`` is Celery's ``Ignore``, so a task is never retried for it.
    Inside a caller's transaction the failure is recorded in that transaction:
    if the caller rolls back, the run is not counted.

    The result is stored as JSON (``DjangoJSONEncoder``) and every call gets
    that JSON form back, first run or duplicate alike, so return JSON-able
    values (a ``Decimal`` comes back as a string).

    Only database effects are covered. Calling another system (e-mail,
    webhook, payment provider) from inside is at-least-once: a crash after the
    call but before the commit repeats it. For such functions use
    ``external=True`` (see :class:`ExternalCall`): the call runs under a lease,
    gets an ``idempotency_key`` keyword argument to pass to the other system,
    and an interrupted call is finished by the reconciler, which asks
    ``verify(idempotency_key)`` before calling again.

    ``consumer`` names the inbox (default: the function's dotted path); keep it
    stable across deploys, or old keys stop matching.

    It decorates a ``django.tasks`` task (or the ``django-tasks`` backport's)
    from above or below ``@task``: above, the task keeps its options and gets
    the decorated function.
    """

    def decorate(fn: Callable[P, R]) -> Callable[..., Any]:
        if _is_django_task(fn):
            task: Any = fn
            return dataclasses.replace(task, func=decorate(task.func))
        name = consumer or f"{fn.__module__}.{fn.__qualname__}"
        if len(name) > 64:
            raise ValueError(f"consumer name {name!r} is longer than 64 characters")
        if external:
            if permanent or max_attempts is not None:
                # Its failures are the reconciler's (RECONCILE_MAX_STALLS, then failed).
                raise ValueError("permanent= and max_attempts= do not apply to external=True")
            if using is not None:
                raise ValueError("external=True calls keep their leases in the default database")
            return _external(fn, key=key, name=name, verify=verify)
        if verify is not None:
            raise ValueError("verify= only applies to external=True")

        if max_attempts is not None and max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        give_up: tuple[type[BaseException], ...] = (PermanentFailure, *permanent)

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            message_id = message_key(key, args, kwargs)
            ran = False
            try:
                with transaction.atomic(using=using):
                    row = _claim(name, message_id, using)
                    if row is None or isinstance(row, _Recorded):
                        outcome = Outcome.DUPLICATE
                        result = row.result if row is not None else None
                    else:
                        ran = True
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
                        functools.partial(_consumed, name, message_id, outcome), using=using
                    )
            except MessageDead:
                raise
            except Exception as exc:
                if not ran:
                    # The claim failed (a lost connection, a deadlock): the work did
                    # not run, so no attempt is counted; the delivery is retried as is.
                    raise
                limit = conf.IDEMPOTENT_MAX_ATTEMPTS if max_attempts is None else max_attempts
                if record_failure(
                    name,
                    message_id,
                    exc,
                    permanent=isinstance(exc, give_up),
                    limit=limit,
                    using=using,
                ):
                    raise MessageDead(f"{name}: {message_id} is dead: {exc!r}"[:500]) from exc
                raise
            return result

        wrapper.consumer = name  # type: ignore[attr-defined]
        return wrapper

    return decorate if func is None else decorate(func)


@dataclasses.dataclass(frozen=True)
class _Recorded:
    """An inbox row that answers a delivery without a run: a duplicate of finished work."""

    result: Any


#: Rows a delivery does not answer from the recorded result.
_NOT_FINISHED = (InboxStatus.PROCESSING, InboxStatus.DEAD, InboxStatus.FAILED)


def _claim(name: str, message_id: str, using: str | None) -> ProcessedMessage | _Recorded | None:
    """The inbox row to run under, in the caller's transaction; or the recorded answer.

    A new key inserts the row (a concurrent duplicate waits on the unique index).
    A row that earlier runs left ``processing`` (they failed, or it was requeued)
    is taken with a locking read, so of concurrent deliveries one runs at a time.
    A dead row raises :class:`MessageDead`, and so does a row an operator marked
    ``failed`` in the admin (its way back is the admin's *Retry*).
    """
    rows = ProcessedMessage.objects.using(using)
    try:
        with transaction.atomic(using=using):
            return rows.create(consumer=name, message_id=message_id, status=InboxStatus.PROCESSING)
    except IntegrityError:
        pass
    found = rows.filter(consumer=name, message_id=message_id).values("status", "result").first()
    if found is not None and found["status"] not in _NOT_FINISHED:
        return _Recorded(found["result"])  # the common duplicate: no lock taken
    # Locked: the latest committed state, and no other run until this one ends.
    row = rows.select_for_update().filter(consumer=name, message_id=message_id).first()
    if row is None:  # deleted meanwhile (retention): nothing to answer from
        return None
    if row.status in (InboxStatus.DEAD, InboxStatus.FAILED):
        raise MessageDead(f"{name}: {message_id} is {row.status}: {row.error}"[:500])
    if row.status != InboxStatus.PROCESSING:
        return _Recorded(row.result)
    row.attempts += 1
    rows.filter(pk=row.pk).update(attempts=F("attempts") + 1, updated_at=timezone.now())
    return row


class ExternalCall(LeasedStep):
    """The leased step behind ``@idempotent(external=True)``, one per consumer.

    Phases (see :mod:`idempotent_orders.leases`):

    1. claim: the inbox row is inserted and committed as ``processing`` with a
       lease, *before* the call, together with the call's JSON arguments (so the
       reconciler can perform it again). The lease is fenced by its claim
       generation: a takeover increments it and the old holder's completion is
       refused.
    2. perform: the function runs with ``idempotency_key=`` (derived from the
       consumer and the key, the same for every attempt) while a heartbeat keeps
       the lease alive.
    3. complete: one fenced UPDATE marks the row ``done`` and records the result.

    A worker killed between 1 and 3 leaves a ``processing`` row; once its lease
    expires the reconciler takes it over and asks ``verify(idempotency_key)``:
    True completes without calling again (the recorded result is then
    ``None``), False calls again with the same key, None (or no verifier)
    waits and, after ``RECONCILE_MAX_STALLS``, fails the row for an operator.
    A call that raised is likewise left to the reconciler, verified first.
    """

    def __init__(self, consumer: str, fn: Callable[..., Any], verify: Verify | None) -> None:
        self.consumer = consumer
        self.fn = fn
        self.verifier = verify
        # perform() and finish() run in the same thread, one lease at a time.
        self._local = threading.local()

    def perform(self, lease: Lease) -> None:
        body = ProcessedMessage.objects.values_list("body", flat=True).get(pk=lease.pk)
        args, kwargs = _decode_call(body)
        self._local.lease, self._local.error = (lease.pk, lease.attempt), None
        self._local.__dict__.pop("result", None)
        try:
            result = self.fn(*args, idempotency_key=lease.idempotency_key, **kwargs)
        except Exception as exc:
            self._local.error = exc
            raise
        self._local.result = _recorded(result)

    def verify(self, lease: Lease) -> Verification:
        if self.verifier is None:
            return Verification.UNKNOWN
        found = self.verifier(lease.idempotency_key)
        if found is None:
            return Verification.UNKNOWN
        return Verification.DONE if found else Verification.NOT_DONE

    def finish(self, lease: Lease) -> StepResult:
        performed = getattr(self._local, "lease", None) == (lease.pk, lease.attempt)
        # A verified effect (no call in this attempt) has no result to record.
        result = self._local.__dict__.pop("result", None) if performed else None

        def record() -> bool:
            return ProcessedMessage.objects.filter(pk=lease.pk).update(result=result) == 1

        if not leases.complete(lease, outcome=Outcome.APPLIED, apply=record):
            return StepResult.SKIPPED
        _consumed(self.consumer, lease.message_id, Outcome.APPLIED)
        return StepResult.COMPLETED

    def last_error(self, lease: Lease) -> BaseException | None:
        """The exception the function raised in this thread for ``lease``, if any."""
        if getattr(self._local, "lease", None) != (lease.pk, lease.attempt):
            return None
        error: BaseException | None = self._local.error
        return error


def _is_django_task(obj: Any) -> bool:
    """Whether ``obj`` is a ``django.tasks`` ``Task`` (Django 6, or the django-tasks backport)."""
    cls = type(obj)
    return (
        cls.__name__ == "Task"
        and cls.__module__.split(".")[0] in {"django", "django_tasks"}
        and dataclasses.is_dataclass(obj)
    )


def _consumed(consumer: str, message_id: str, outcome: Outcome) -> None:
    consumed(
        consumer,
        message_id,
        outcome,
        reason="already processed" if outcome is Outcome.DUPLICATE else "",
    )


def _encode_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    task = None
    if args and isinstance(args[0], Task):
        # A bound Celery task's ``self``: replayed as the registered task of that name.
        task, args = args[0].name, args[1:]
    try:
        return json.dumps(
            {"module": fn.__module__, "task": task, "args": list(args), "kwargs": dict(kwargs)},
            cls=DjangoJSONEncoder,
        )
    except TypeError as exc:
        raise TypeError(
            f"the arguments of an external=True call must be JSON-serialisable: {exc}"
        ) from exc


def _decode_call(body: str) -> tuple[list[Any], dict[str, Any]]:
    call = json.loads(body)
    args = list(call["args"])
    if call.get("task"):
        args.insert(0, current_app.tasks[call["task"]])
    return args, dict(call["kwargs"])


def load_step(row: ProcessedMessage) -> LeasedStep | None:
    """The step of ``row``'s consumer, importing the module that declared it if need be.

    A reconciler process (``manage.py reconcile_orders``) may not have imported
    the module of an ``external=True`` function; the call stored on the row
    names it.
    """
    step = leases.get_step(row.consumer)
    if step is not None or not row.body:
        return step
    try:
        module = json.loads(row.body)["module"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(module, str):
        return None
    try:
        importlib.import_module(module)
    except ImportError:
        logger.warning("cannot import %s for consumer %s", module, row.consumer)
        return None
    return leases.get_step(row.consumer)


def _external(
    fn: Callable[..., Any], *, key: KeySpec, name: str, verify: Verify | None
) -> Callable[..., Any]:
    step = ExternalCall(name, fn, verify)
    leases.register_step(step)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        message_id = message_key(key, args, kwargs)
        if transaction.get_connection().in_atomic_block:
            # The claim must be committed before the other system is called, or
            # a crash would leave an effect with no row for the reconciler.
            raise RuntimeError(f"{name}: an external=True call cannot run inside a transaction")
        claimed = leases.claim(
            consumer=name,
            message_id=message_id,
            token=0,
            message_type="call",
            # Only the reconciler takes expired leases over: it verifies first.
            allow_takeover=False,
            body=_encode_call(fn, args, kwargs),
        )
        if claimed.state is ClaimState.DONE:
            assert claimed.row is not None
            _consumed(name, message_id, Outcome.DUPLICATE)
            return claimed.row.result
        if claimed.state is ClaimState.FAILED:
            raise CallFailed(f"{name}: {message_id} was marked failed for an operator")
        if claimed.state is ClaimState.BUSY:
            raise CallInProgress(f"{name}: {message_id} is in progress or awaits the reconciler")
        assert claimed.lease is not None
        result = leases.run_step(step, claimed.lease, via="worker")
        if result is StepResult.COMPLETED:
            return (
                ProcessedMessage.objects.values_list("result", flat=True)
                .filter(pk=claimed.lease.pk)
                .first()
            )
        error = step.last_error(claimed.lease)
        if error is not None:
            raise error  # the row waits for the reconciler, which verifies before retrying
        if result is StepResult.FAILED:
            raise CallFailed(f"{name}: {message_id} was marked failed for an operator")
        raise CallInProgress(f"{name}: {message_id} lost its lease; the reconciler finishes it")

    # Callers (and Celery's argument check) do not pass idempotency_key: the wrapper does.
    signature = inspect.signature(fn)
    wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p for p in signature.parameters.values() if p.name != "idempotency_key"]
    )
    wrapper.consumer = name  # type: ignore[attr-defined]
    wrapper.step = step  # type: ignore[attr-defined]
    return wrapper
