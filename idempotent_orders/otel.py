"""OpenTelemetry spans of the app's messages: consumed, received, sent and fired.

With ``opentelemetry-api`` installed (the ``otel`` extra), each of these gets a span
that follows OpenTelemetry's messaging semantic conventions:

| what | kind | ``messaging.operation.type`` | ``messaging.destination.name`` |
| --- | --- | --- | --- |
| a message consumed | CONSUMER | ``process`` | the consumer (``payments``) |
| each message of a batch | CONSUMER | ``process`` | the consumer |
| a webhook received | CONSUMER | ``receive`` | the provider (``stripe``) |
| an outbox row written | PRODUCER | ``send`` | the task's name |
| a timer fired | CONSUMER | ``process`` | ``timers`` |

Each span also carries ``messaging.system`` (``idempotent_orders``),
``messaging.operation.name``, ``messaging.message.id`` and the app's own
``idempotent_orders.message_type``, ``idempotent_orders.order_id``,
``idempotent_orders.attempt`` (where it is known) and ``idempotent_orders.outcome``
(``applied``, ``duplicate``, ``parked``, ``rejected``, ``failed``, ...). An exception
is recorded on the span and sets its status to ERROR; so does the outcome ``failed``.

A span is a child of the producer's context: the OpenTelemetry context in effect when
its span is in the trace the app carries (an instrumented Celery task's span, a Django
request's), else the W3C ``traceparent`` the app carries by hand
(:mod:`idempotent_orders.tracing`: the task's message headers, an outbox row's, a
timer's, a webhook request's), extracted with the W3C propagator. An outbox row stores
its ``send`` span's context, so the consumer of the row is that span's child: one
order's journey is one trace.

Without ``opentelemetry-api`` nothing here runs: the decorators return the function
they are given, and the context managers do nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, TypeVar, cast

from idempotent_orders import __version__, tracing

_trace: Any
try:
    from opentelemetry import context as _otel_context
    from opentelemetry import trace as _trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the ``otel`` extra is not installed: every span is skipped
    _trace = None

__all__ = [
    "ENABLED",
    "SYSTEM",
    "attached",
    "recording",
    "sending",
    "traced_batch",
    "traced_consume",
    "traced_fire",
    "traced_receive",
]

#: Whether ``opentelemetry-api`` is importable (spans are emitted).
ENABLED = _trace is not None

#: The value of ``messaging.system`` on every span of the app.
SYSTEM = "idempotent_orders"

#: The tracer provider spans go to; None for OpenTelemetry's global one.
provider: Any = None

#: The messages a span already covers while they are consumed (a batch's, a timer's):
#: the consume road adds none of its own for them (see :func:`_key`).
_covered: ContextVar[frozenset[str]] = ContextVar(
    "idempotent_orders_otel_covered", default=frozenset()
)

_F = TypeVar("_F", bound=Callable[..., Any])

if ENABLED:
    _PROPAGATOR = TraceContextTextMapPropagator()
    _CONSUMER = SpanKind.CONSUMER
    _PRODUCER = SpanKind.PRODUCER
    #: The API's own providers: with nothing behind them, a span records nothing.
    _API_ONLY = (_trace.ProxyTracerProvider, _trace.NoOpTracerProvider)


def recording() -> bool:
    """Whether a span goes anywhere: a provider set here (:data:`provider`), or one an
    SDK set globally. With the API alone (no SDK configured) the app makes no span at
    all, so a message costs what it costs without OpenTelemetry."""
    return ENABLED and (
        provider is not None or not isinstance(_trace.get_tracer_provider(), _API_ONLY)
    )


_tracers: dict[int, Any] = {}


def _tracer() -> Any:
    source = provider if provider is not None else _trace.get_tracer_provider()
    tracer = _tracers.get(id(source))
    if tracer is None:
        tracer = _tracers[id(source)] = source.get_tracer("idempotent_orders", __version__)
    return tracer


def _trace_id(traceparent: str) -> int:
    return int(traceparent[3:35], 16)


def _parent(carried: str | None = None, *, strict: bool = False) -> tuple[Any, list[Any]]:
    """The context a new span is a child of, and the links it carries.

    The current OpenTelemetry context when its span is in the carried trace (it is the
    deeper one: an instrumented task's span under the producer's), or when nothing is
    carried; else the carried ``traceparent`` (``carried``, default the app's
    :func:`~idempotent_orders.tracing.carried`), linked to the current span. With
    ``strict`` the carried one is the parent whatever is current.
    """
    current = _otel_context.get_current()
    if carried is None:
        carried = tracing.carried().traceparent
    if not carried or not tracing.valid_traceparent(carried):
        return current, []
    here = _trace.get_current_span(current).get_span_context()
    if here.is_valid and here.trace_id == _trace_id(carried) and not strict:
        return current, []
    parent = _PROPAGATOR.extract({"traceparent": carried}, context=current)
    return parent, [Link(here)] if here.is_valid else []


def _traceparent_of(span: Any) -> str:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=_trace.set_span_in_context(span))
    value = carrier.get("traceparent", "")
    return value if tracing.valid_traceparent(value) else ""


def _attributes(
    operation: str,
    destination: str,
    message_id: Any = None,
    message_type: Any = None,
    order_id: Any = None,
    attempt: int | None = None,
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.destination.name": destination,
    }
    if isinstance(message_id, str) and message_id:
        attributes["messaging.message.id"] = message_id
    if isinstance(message_type, str) and message_type:
        attributes["idempotent_orders.message_type"] = message_type
    if isinstance(order_id, int | str) and not isinstance(order_id, bool) and str(order_id):
        attributes["idempotent_orders.order_id"] = str(order_id)
    if attempt is not None:
        attributes["idempotent_orders.attempt"] = attempt
    return attributes


def _of_message(message: Any) -> dict[str, Any]:
    """What a raw message says of itself (nothing of a message that is not a mapping)."""
    if not isinstance(message, Mapping):
        return {}
    return {
        "message_id": message.get("message_id"),
        "message_type": message.get("type"),
        "order_id": message.get("order_id"),
    }


def _key(message: Any) -> str:
    """How :data:`_covered` names a message: its id, else the object itself."""
    if isinstance(message, Mapping) and message.get("message_id") is not None:
        return f"id:{message.get('message_id')}"
    return f"object:{id(message)}"


def _attempt() -> int | None:
    """The running Celery task's attempt (1 for its first run), None outside a task."""
    task = tracing._current_task
    request = getattr(task, "request", None) if task else None
    if request is None or getattr(request, "id", None) is None:
        return None
    return int(getattr(request, "retries", 0) or 0) + 1


def _set_outcome(span: Any, outcome: Any) -> None:
    value = str(getattr(outcome, "value", outcome) or "")
    if not value:
        return
    span.set_attribute("idempotent_orders.outcome", value)
    if value == "failed":
        span.set_status(Status(StatusCode.ERROR, "the message failed"))


def _failed(span: Any, exc: BaseException) -> None:
    from idempotent_orders.consuming.failures import MessageFailed

    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:500]))
    if isinstance(exc, MessageFailed):
        span.set_attribute("idempotent_orders.outcome", "failed")


@contextmanager
def _span(
    name: str,
    kind: Any,
    attributes: dict[str, Any],
    *,
    carried: str | None = None,
    strict: bool = False,
    cover: frozenset[str] = frozenset(),
) -> Iterator[Any]:
    """A span, current in the block; what raises is recorded on it and re-raised."""
    parent, links = _parent(carried, strict=strict)
    span = _tracer().start_span(name, context=parent, kind=kind, attributes=attributes, links=links)
    token = _otel_context.attach(_trace.set_span_in_context(span, parent))
    covered = _covered.set(_covered.get() | cover) if cover else None
    try:
        yield span
    except BaseException as exc:
        _failed(span, exc)
        raise
    finally:
        if covered is not None:
            _covered.reset(covered)
        _otel_context.detach(token)
        span.end()


# -- the consume road ---------------------------------------------------------------------


def traced_consume(function: _F) -> _F:
    """``consume_message(message, *, consumer)`` in a ``process`` span of its own."""
    if not ENABLED:
        return function

    @functools.wraps(function)
    def consume_message(message: Any, *, consumer: str) -> Any:
        if not recording() or _key(message) in _covered.get():
            return function(message, consumer=consumer)
        attributes = _attributes("process", consumer, attempt=_attempt(), **_of_message(message))
        with _span(f"process {consumer}", _CONSUMER, attributes) as span:
            outcome = function(message, consumer=consumer)
            _set_outcome(span, outcome)
            return outcome

    return cast(_F, consume_message)


def traced_batch(function: _F) -> _F:
    """``consume_batch(messages, *, consumer)``: a ``process`` span for each message.

    The messages are consumed together, so their spans start and end together, each a
    child of the batch's delivery context with its own message's attributes and outcome;
    what raises is recorded on every one of them (the whole chunk rolled back).
    """
    if not ENABLED:
        return function

    @functools.wraps(function)
    def consume_batch(messages: Sequence[Any], *, consumer: str) -> Any:
        if not recording():
            return function(messages, consumer=consumer)
        parent, links = _parent()
        tracer = _tracer()
        attempt = _attempt()
        spans = [
            tracer.start_span(
                f"process {consumer}",
                context=parent,
                kind=_CONSUMER,
                attributes={
                    **_attributes("process", consumer, attempt=attempt, **_of_message(message)),
                    "messaging.batch.message_count": len(messages),
                },
                links=links,
            )
            for message in messages
        ]
        token = _covered.set(_covered.get() | {_key(message) for message in messages})
        try:
            outcomes = function(messages, consumer=consumer)
        except BaseException as exc:
            for span in spans:
                _failed(span, exc)
                span.end()
            raise
        finally:
            _covered.reset(token)
        for span, outcome in zip(spans, outcomes, strict=True):
            _set_outcome(span, outcome)
            span.end()
        return outcomes

    return cast(_F, consume_batch)


# -- timers and webhooks ------------------------------------------------------------------


def traced_fire(function: _F) -> _F:
    """``fire(timer)`` in a ``process`` span, a child of the context the timer was
    scheduled in (``Timer.traceparent``), linked to the firing pass's own."""
    if not ENABLED:
        return function

    @functools.wraps(function)
    def fire(timer: Any) -> Any:
        if not recording():
            return function(timer)
        attributes = _attributes(
            "process",
            "timers",
            message_id=timer.message_id,
            message_type=timer.message_type,
            order_id=timer.order_id,
            attempt=int(timer.attempts or 0) + 1,
        )
        attributes["idempotent_orders.transition"] = timer.transition
        carried = timer.traceparent or None
        cover = frozenset({f"id:{timer.message_id}"})
        with _span("process timers", _CONSUMER, attributes, carried=carried, cover=cover) as span:
            outcome = function(timer)
            _set_outcome(span, outcome)
            return outcome

    return cast(_F, fire)


def traced_receive(function: _F) -> _F:
    """The webhook ingress's ``receive(name, body, headers, ...)`` in a ``receive`` span:
    a child of the request's ``traceparent`` header (or of an instrumented request's
    span); the event's id, type, order and what became of it (``received``,
    ``duplicate``, the inline consume's outcome, or ``rejected`` with its problem code)."""
    if not ENABLED:
        return function

    @functools.wraps(function)
    def receive(*args: Any, **kwargs: Any) -> Any:
        if not recording():
            return function(*args, **kwargs)
        name = str(args[0] if args else kwargs["name"])
        headers = args[2] if len(args) > 2 else kwargs.get("headers", {})
        carried = str(headers.get("traceparent", "") or "").strip().lower()
        attributes = _attributes("receive", name)
        with _span(f"receive {name}", _CONSUMER, attributes, carried=carried or None) as span:
            receipt = function(*args, **kwargs)
            if span.is_recording():
                _receipt_attributes(span, receipt)
            return receipt

    return cast(_F, receive)


def _receipt_attributes(span: Any, receipt: Any) -> None:
    event = receipt.event
    if event is not None:
        for key, value in _attributes(
            "receive",
            "",
            message_id=event.event_id or event.claimed_id,
            message_type=event.message_type,
            order_id=event.order_id,
        ).items():
            if key.startswith(("messaging.message", "idempotent_orders.")):
                span.set_attribute(key, value)
    span.set_attribute("http.response.status_code", receipt.status)
    if receipt.status >= 400:
        span.set_attribute("idempotent_orders.outcome", "rejected")
        span.set_attribute("idempotent_orders.problem", receipt.code)
        if receipt.status >= 500:
            span.set_status(Status(StatusCode.ERROR, receipt.detail[:500]))
        return
    _set_outcome(span, receipt.body.get("outcome") or receipt.body.get("status"))


# -- the outbox ---------------------------------------------------------------------------


class Sending:
    """What :func:`sending` yields: the ``traceparent`` to store with the row(s)."""

    def __init__(self, traceparent: str, span: Any = None) -> None:
        #: The ``send`` span's context (the one given when no span is recorded).
        self.traceparent = traceparent
        self.span = span

    def outcome(self, value: str) -> None:
        """Say what became of the send (``queued``, ``duplicate``)."""
        if self.span is not None:
            self.span.set_attribute("idempotent_orders.outcome", value)


@contextmanager
def sending(
    task_name: str,
    traceparent: str,
    *,
    explicit: bool = False,
    message_id: str | None = None,
    message: Any = None,
    count: int | None = None,
) -> Iterator[Sending]:
    """A ``send`` span around writing outbox row(s) of ``task_name``; yields the
    ``traceparent`` the row(s) store: the span's context, so the consumer is its child.

    ``traceparent`` is the one the row would store without a span; with ``explicit``
    (the caller passed it) the span is its child whatever else is current.
    """
    if not recording():
        yield Sending(traceparent)
        return
    attributes = _attributes("send", task_name, message_id=message_id)
    said = _of_message(message)
    for key in ("message_type", "order_id"):
        if said.get(key) is not None:
            attributes.update(_attributes("send", task_name, **{key: said[key]}))
    if count is not None:
        attributes["messaging.batch.message_count"] = count
    carried = traceparent if explicit else None
    with _span(
        f"send {task_name}", _PRODUCER, attributes, carried=carried, strict=explicit
    ) as span:
        yield Sending(_traceparent_of(span) or traceparent, span)


def attached(traceparent: str) -> Any:
    """Make ``traceparent`` (an outbox row's) the current OpenTelemetry context in the
    block: what an instrumented publish (Celery's) does there is the row's child."""
    if not ENABLED or not traceparent or not tracing.valid_traceparent(traceparent):
        return nullcontext()
    return _attached(traceparent)


@contextmanager
def _attached(traceparent: str) -> Iterator[None]:
    token = _otel_context.attach(_PROPAGATOR.extract({"traceparent": traceparent}))
    try:
        yield
    finally:
        _otel_context.detach(token)
