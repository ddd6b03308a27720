"""Trace context carried from a producer, through the outbox, to the consumer's task.

A :class:`TraceContext` is a W3C ``traceparent`` and a correlation id. The
producer's context is read when :func:`~idempotent_orders.outbox.publish_on_commit`
writes a row (an explicit argument, else :func:`current`), stored with the
row, and sent as the task's message headers ``traceparent`` and
``x-correlation-id`` (Celery's own ``correlation_id`` is the task id).
Around every Celery task the app restores the headers of the message into
the context variable, so :func:`current` inside the task
(and any row it writes to the outbox) carries the same trace: one order's
journey is one trace. :class:`TraceLogFilter` adds both to log records.

Where :func:`current` looks: :func:`use` / the restored context of the running task,
else the running Celery task's own message headers (:func:`carried`: the context the
app carries by hand); OpenTelemetry's current span, when ``opentelemetry-api`` is
installed, wins where nothing is carried or where it is in the carried trace (it is then
the deeper context: the span of the message being consumed, under its producer's).
:mod:`idempotent_orders.otel` makes the spans.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any

__all__ = ["TraceContext", "TraceLogFilter", "carried", "current", "use", "valid_traceparent"]

#: W3C Trace Context ``traceparent``: version-traceid-parentid-flags, lowercase hex.
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def valid_traceparent(value: str) -> bool:
    """Whether ``value`` is a well-formed ``traceparent`` (all-zero ids are invalid)."""
    if not _TRACEPARENT.match(value) or value.startswith("ff"):
        return False
    _, trace_id, parent_id, _ = value.split("-")
    return set(trace_id) != {"0"} and set(parent_id) != {"0"}


@dataclass(frozen=True)
class TraceContext:
    """A W3C ``traceparent`` ("" when none) and a correlation id ("" when none)."""

    traceparent: str = ""
    correlation_id: str = ""

    def __bool__(self) -> bool:
        return bool(self.traceparent or self.correlation_id)

    def headers(self) -> dict[str, str]:
        """The message headers that carry it (only those that are set)."""
        headers = {"traceparent": self.traceparent, CORRELATION_HEADER: self.correlation_id}
        return {k: v for k, v in headers.items() if v}


#: The message header of the correlation id (Celery's ``correlation_id`` is the task id).
CORRELATION_HEADER = "x-correlation-id"

_context: ContextVar[TraceContext | None] = ContextVar("idempotent_orders_trace", default=None)


@contextmanager
def use(traceparent: str = "", correlation_id: str = "") -> Iterator[TraceContext]:
    """Make this trace context current in the block (a request, a script, a test)."""
    context = TraceContext(_clean(traceparent), str(correlation_id or ""))
    token = _context.set(context)
    try:
        yield context
    finally:
        _context.reset(token)


def carried() -> TraceContext:
    """The trace context the app carries here: a :func:`use` block's or the restored one
    of the running task, else the running Celery task's message headers (empty when
    there is none); OpenTelemetry's context is not looked at."""
    context = _context.get()
    if context:
        return context
    return _from_celery_task()


def current() -> TraceContext:
    """The trace context in effect here (empty when there is none): :func:`carried`, or
    OpenTelemetry's current span when nothing is carried or it is in the carried trace."""
    context = carried()
    span = _from_opentelemetry()
    if span and (not context.traceparent or span[3:35] == context.traceparent[3:35]):
        return TraceContext(span, context.correlation_id)
    return context


def from_headers(headers: Any) -> TraceContext:
    """The trace context in a message's headers: a mapping, or a Celery request (whose
    custom headers are attributes, or sit in its ``headers`` dict, by Celery version).
    """
    sources = [headers]
    if not isinstance(headers, dict) and isinstance(getattr(headers, "headers", None), dict):
        sources.append(headers.headers)

    def read(name: str) -> str:
        for source in sources:
            value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
            if value:
                return str(value)
        return ""

    return TraceContext(_clean(read("traceparent")), read(CORRELATION_HEADER))


def _clean(traceparent: str) -> str:
    value = str(traceparent or "").strip().lower()
    return value if valid_traceparent(value) else ""


#: The context of no trace (one object: a message outside any trace builds none).
_EMPTY = TraceContext()

_current_task: Any
try:  # imported once (a proxy: the task running when it is read)
    from celery import current_task as _current_task
except ImportError:  # pragma: no cover - celery is a dependency
    _current_task = None


def _from_celery_task() -> TraceContext:
    task = _current_task
    request = getattr(task, "request", None) if task else None
    if request is None:
        return _EMPTY
    context = from_headers(request)
    return context if context else _EMPTY


_otel_inject: Any
_otel_current_span: Any
try:  # looked up once: a failed import on every call would cost the producer
    from opentelemetry.propagate import inject as _otel_inject
    from opentelemetry.trace import get_current_span as _otel_current_span
except ImportError:
    _otel_inject = _otel_current_span = None


def _from_opentelemetry() -> str:
    """The current span's ``traceparent`` ("" without a valid current span: nothing to
    propagate, and the propagators are not run)."""
    if _otel_inject is None or not _otel_current_span().get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    _otel_inject(carrier)
    return _clean(carrier.get("traceparent", ""))


# -- restored around each task (connected in receivers.py) ---------------------------------

_tokens: dict[str, Token[TraceContext | None]] = {}


def restore_for_task(task_id: str, request: Any) -> TraceContext:
    """Make the trace context of the task's message current while the task runs."""
    context = from_headers(request)
    _tokens[task_id] = _context.set(context or None)
    return context


def forget_for_task(task_id: str) -> None:
    token = _tokens.pop(task_id, None)
    if token is not None:
        try:
            _context.reset(token)
        except ValueError:  # set in another context (a pool thread): just clear it
            _context.set(None)


class TraceLogFilter(logging.Filter):
    """Adds ``traceparent`` and ``correlation_id`` (when set) to every record it passes.

    Attach it to a handler; ``observability.JsonFormatter`` then writes both.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        context = current()
        if context.traceparent and not hasattr(record, "traceparent"):
            record.traceparent = context.traceparent
        if context.correlation_id and not hasattr(record, "correlation_id"):
            record.correlation_id = context.correlation_id
        return True
