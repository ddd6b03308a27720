"""OpenTelemetry spans: one order's journey is one trace, read back from the SDK's exporter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from django.conf import settings
from django.db import transaction
from django.test import Client, override_settings
from django_fsm.signals import post_transition
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from idempotent_orders import get_order_model, otel, tracing
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.failures import MessageFailed
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import OutboxMessage, Timer
from idempotent_orders.outbox import publish_on_commit, relay_outbox
from idempotent_orders.receivers import forget_trace, restore_trace
from idempotent_orders.tasks import consume_payment
from idempotent_orders.timers import fire, schedule
from idempotent_orders.webhooks import ingress
from idempotent_orders.webhooks.signing import stripe_signature
from tests.support.messages import payment
from tests.support.services import ROOT
from tests.webhooks.test_webhooks import SECRET, URL, event, provider_settings

#: A producer's context as a message carries it (the W3C specification's example).
TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TP_TRACE, TP_SPAN = int(TP[3:35], 16), int(TP[36:52], 16)


@pytest.fixture
def provider(monkeypatch: pytest.MonkeyPatch) -> TracerProvider:
    """The app's spans go to this provider (the global one stays untouched)."""
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    monkeypatch.setattr(otel, "provider", tracer_provider)
    return tracer_provider


@pytest.fixture
def spans(provider: TracerProvider) -> Callable[[], list[ReadableSpan]]:
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return lambda: list(exporter.get_finished_spans())


def named(found: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in found if span.name == name]


def traceparent_of(span: Any) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


@pytest.fixture
def worker() -> Iterator[Callable[[dict[str, Any]], Any]]:
    """Runs a block as a Celery worker would: the message's headers restored around it."""
    task = SimpleNamespace(request=None)

    def restore(headers: dict[str, Any]) -> Any:
        task.request = SimpleNamespace(is_eager=False, headers=headers, **headers)
        restore_trace(task_id="t-1", task=task)
        return task

    yield restore
    forget_trace(task_id="t-1", task=task)


def expiring() -> Any:
    return override_settings(
        IDEMPOTENT_ORDERS={
            **settings.IDEMPOTENT_ORDERS,
            "PAYMENT_TIMEOUT": 900,
            "OUTBOX_PUBLISH_ON_COMMIT": False,
        }
    )


@pytest.mark.django_db
def test_one_orders_journey_is_one_trace(
    provider: TracerProvider,
    spans: Callable[[], list[ReadableSpan]],
    make_order: Callable[..., Any],
    worker: Callable[[dict[str, Any]], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[tuple[dict[str, Any], Any]] = []
    monkeypatch.setattr(
        consume_payment,
        "apply_async",
        lambda **kw: sent.append((kw, trace.get_current_span().get_span_context())),
    )
    tracer = provider.get_tracer("tests")
    with expiring():
        # The checkout request: the order, its expiry timer and the payment message.
        checkout = tracer.start_as_current_span("POST /checkout", kind=SpanKind.SERVER)
        with checkout as request, transaction.atomic():
            order = make_order()
            message = payment(order)
            row = publish_on_commit(consume_payment, message, order_key=str(order.pk))
        relay_outbox()
        # The worker consumes the payment, then its redelivery.
        ((options, current_at_publish),) = sent
        worker(options["headers"])
        assert consume_message(message, consumer="payments") == "applied"
        assert consume_message(message, consumer="payments") == "duplicate"
        # The beat fires the expiry timer later, in a trace of its own.
        with tracer.start_as_current_span("beat pass") as beat:
            (timer,) = Timer.objects.filter(order=order)
            assert fire(timer) == "stale"
    found = spans()
    request_id = request.get_span_context().span_id
    trace_id = request.get_span_context().trace_id

    (send,) = named(found, "send idempotent_orders.consume_payment")
    assert send.kind is SpanKind.PRODUCER
    assert send.parent is not None
    assert send.parent.span_id == request_id
    assert send.context.trace_id == trace_id
    assert dict(send.attributes or {}) == {
        "messaging.system": "idempotent_orders",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": "idempotent_orders.consume_payment",
        "messaging.message.id": message["message_id"],
        "idempotent_orders.message_type": "payment.succeeded",
        "idempotent_orders.order_id": str(order.pk),
        "idempotent_orders.outcome": "queued",
    }
    # The row, and the message's headers, carry the send span's context.
    assert row.traceparent == traceparent_of(send)
    assert options["headers"]["traceparent"] == row.traceparent
    # The publish ran in the row's context (an instrumented Celery publish is its child).
    assert current_at_publish.span_id == send.context.span_id

    processed = named(found, "process payments")
    assert [span.attributes["idempotent_orders.outcome"] for span in processed] == [
        "applied",
        "duplicate",
    ]
    for span in processed:
        assert span.kind is SpanKind.CONSUMER
        assert span.parent is not None
        assert span.parent.span_id == send.context.span_id
        assert span.context.trace_id == trace_id
        assert span.attributes["messaging.operation.type"] == "process"
        assert span.attributes["messaging.destination.name"] == "payments"
        assert span.attributes["messaging.message.id"] == message["message_id"]
        assert span.attributes["idempotent_orders.order_id"] == str(order.pk)
        assert span.status.status_code is StatusCode.UNSET

    # The timer fires in the checkout's trace, linked to the beat pass that fired it.
    (fired,) = named(found, "process timers")
    assert fired.parent is not None
    assert fired.parent.span_id == request_id
    assert fired.context.trace_id == trace_id
    assert [link.context.span_id for link in fired.links] == [beat.get_span_context().span_id]
    assert fired.attributes["messaging.message.id"] == timer.message_id
    assert fired.attributes["idempotent_orders.attempt"] == 1
    assert fired.attributes["idempotent_orders.outcome"] == "stale"
    assert timer.traceparent == traceparent_of(request)


@pytest.mark.django_db
def test_a_timer_that_applies_is_one_span_not_two(
    spans: Callable[[], list[ReadableSpan]], make_order: Callable[..., Any]
) -> None:
    from django.utils import timezone

    order = make_order()
    with tracing.use(TP), transaction.atomic():
        timer = schedule(order, "expire", at=timezone.now())
    assert timer.traceparent == TP
    assert fire(timer) == "applied"
    (fired,) = spans()
    assert fired.name == "process timers"
    assert fired.parent is not None
    assert (fired.context.trace_id, fired.parent.span_id) == (TP_TRACE, TP_SPAN)
    assert fired.attributes["idempotent_orders.outcome"] == "applied"
    assert fired.attributes["idempotent_orders.transition"] == "expire"


@pytest.mark.django_db
def test_each_message_of_a_batch_gets_its_span_and_outcome(
    spans: Callable[[], list[ReadableSpan]], make_order: Callable[..., Any]
) -> None:
    order = make_order()
    message = payment(order)
    unknown = {"message_id": "bad-1", "type": "no.such.type", "order_id": order.pk}
    with tracing.use(TP):
        outcomes = consume_batch([message, message, unknown], consumer="payments")
    assert outcomes == ["applied", "duplicate", "rejected"]
    found = spans()  # the rejected one's consume_message adds no span of its own
    assert [span.name for span in found] == ["process payments"] * 3
    assert [span.attributes["idempotent_orders.outcome"] for span in found] == outcomes
    assert [span.attributes["messaging.message.id"] for span in found] == [
        message["message_id"],
        message["message_id"],
        "bad-1",
    ]
    for span in found:
        assert span.parent is not None
        assert (span.context.trace_id, span.parent.span_id) == (TP_TRACE, TP_SPAN)
        assert span.attributes["messaging.batch.message_count"] == 3


@pytest.mark.django_db(transaction=True)
def test_a_failing_message_is_an_error_span_with_its_exception(
    spans: Callable[[], list[ReadableSpan]], make_order: Callable[..., Any]
) -> None:
    def broken(sender: Any, **kwargs: Any) -> None:
        raise ZeroDivisionError("a bug in a receiver")

    post_transition.connect(broken, sender=get_order_model(), weak=False)
    try:
        with pytest.raises(MessageFailed):
            consume_message(payment(make_order()), consumer="payments")
    finally:
        post_transition.disconnect(broken, sender=get_order_model())
    (span,) = spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["idempotent_orders.outcome"] == "failed"
    (raised,) = [e for e in span.events if e.name == "exception"]
    assert raised.attributes["exception.type"].endswith("MessageFailed")
    assert "a bug in a receiver" in raised.attributes["exception.message"]


@pytest.mark.django_db
def test_a_webhook_is_received_sent_and_consumed_in_the_senders_trace(
    spans: Callable[[], list[ReadableSpan]],
    make_order: Callable[..., Any],
    worker: Callable[[dict[str, Any]], Any],
) -> None:
    order = make_order()
    body = json.dumps(event(order, event_id="evt_t", payment_id="pi_t")).encode()
    config = {**provider_settings(), "OUTBOX_PUBLISH_ON_COMMIT": False}
    with override_settings(IDEMPOTENT_ORDERS=config):
        for _ in range(2):  # the provider delivers it twice
            response = Client().post(
                URL,
                data=body,
                content_type="application/json",
                HTTP_STRIPE_SIGNATURE=stripe_signature(SECRET, body),
                HTTP_TRACEPARENT=TP,
            )
            assert response.status_code == 200
        (row,) = OutboxMessage.objects.filter(task_name=ingress.TASK)
        worker(tracing.TraceContext(row.traceparent).headers())
        assert ingress.process_event(row.payload["event"]) == "applied"
    found = spans()
    received = named(found, "receive fakepay")
    assert [span.attributes["idempotent_orders.outcome"] for span in received] == [
        "received",
        "duplicate",
    ]
    for span in received:
        assert span.kind is SpanKind.CONSUMER
        assert span.parent is not None
        assert (span.context.trace_id, span.parent.span_id) == (TP_TRACE, TP_SPAN)
        assert span.attributes["messaging.operation.type"] == "receive"
        assert span.attributes["messaging.message.id"] == "evt_t"
        assert span.attributes["idempotent_orders.message_type"] == "payment.succeeded"
        assert span.attributes["http.response.status_code"] == 200
    (send,) = named(found, f"send {ingress.TASK}")
    assert send.parent is not None
    assert send.parent.span_id == received[0].context.span_id
    assert row.traceparent == traceparent_of(send)
    (processed,) = named(found, "process payments")
    assert processed.parent is not None
    assert processed.parent.span_id == send.context.span_id
    assert processed.attributes["messaging.message.id"] == "evt_t"
    assert processed.attributes["idempotent_orders.outcome"] == "applied"


@pytest.mark.django_db
def test_a_refused_webhook_is_a_rejected_receive_span(
    spans: Callable[[], list[ReadableSpan]],
) -> None:
    with override_settings(IDEMPOTENT_ORDERS=provider_settings()):
        response = Client().post(URL, data=b"{}", content_type="application/json")
    assert response.status_code == 400
    (span,) = spans()
    assert span.name == "receive fakepay"
    assert span.attributes["idempotent_orders.outcome"] == "rejected"
    assert span.attributes["idempotent_orders.problem"] == response.json()["code"]
    assert span.status.status_code is StatusCode.UNSET  # a refusal is an answer, not a fault


@pytest.mark.django_db
def test_an_explicit_traceparent_is_the_send_spans_parent(
    spans: Callable[[], list[ReadableSpan]], provider: TracerProvider
) -> None:
    config = {**settings.IDEMPOTENT_ORDERS, "OUTBOX_PUBLISH_ON_COMMIT": False}
    # Another trace is current; the caller names the producer's context.
    elsewhere = provider.get_tracer("tests").start_as_current_span("elsewhere")
    with override_settings(IDEMPOTENT_ORDERS=config), elsewhere:
        row = publish_on_commit(consume_payment, {"message_id": "m-x"}, traceparent=TP)
    (send,) = named(spans(), "send idempotent_orders.consume_payment")
    assert send.parent is not None
    assert (send.context.trace_id, send.parent.span_id) == (TP_TRACE, TP_SPAN)
    assert row.traceparent == traceparent_of(send)


def test_without_opentelemetry_nothing_is_wrapped_and_messages_are_consumed(
    tmp_path: Any,
) -> None:
    # opentelemetry made unimportable before anything of the app is imported.
    script = """
import sys
import uuid
for name in [m for m in sys.modules if m.startswith("opentelemetry")]:
    del sys.modules[name]
sys.modules["opentelemetry"] = None
import django
django.setup()
from django.core.management import call_command
from django.db import transaction
from idempotent_orders import get_order_model, otel, tracing
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.outbox import publish_on_commit
from idempotent_orders.timers import fire
from idempotent_orders.webhooks.ingress import receive

call_command("migrate", verbosity=0)
wrapped = [hasattr(f, "__wrapped__") for f in (consume_message, consume_batch, fire, receive)]
order = get_order_model()._default_manager.create(
    business_key="no-otel", amount="12.50", currency="CNY"
)
message = {"message_id": f"no-otel-{uuid.uuid4().hex}", "type": "payment.succeeded",
           "order_id": order.pk,
           "payload": {"payment_id": "p1", "amount": "12.50", "currency": "CNY"}}
tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
with tracing.use(tp), transaction.atomic():
    row = publish_on_commit("idempotent_orders.consume_payment", message)
print(otel.ENABLED, wrapped, row.traceparent == tp,
      consume_message(message, consumer="payments").value,
      consume_batch([message], consumer="payments")[0].value)
"""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "IO_TEST_DATABASE": "sqlite",
        "IO_WORKER_DB": "1",
        "IO_TEST_DB_NAME": str(tmp_path / "no-otel"),
    }
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last == "False [False, False, False, False] True applied duplicate"


@pytest.mark.django_db
def test_with_the_api_alone_a_message_makes_no_span(
    make_order: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No provider here and none set globally (the API's proxy): nothing records a span,
    # so none is started: a consumed message costs what it costs without OpenTelemetry.
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert not otel.recording()
    started: list[str] = []
    real = otel._span

    def counting(name: str, *args: Any, **kwargs: Any) -> Any:
        started.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(otel, "_span", counting)
    order = make_order()
    message = payment(order)
    outcomes = [consume_message(message, consumer="payments") for _ in range(2)]
    assert [o.value for o in outcomes] == ["applied", "duplicate"]
    assert started == []
    monkeypatch.setattr(otel, "provider", TracerProvider())
    assert otel.recording()
    consume_message(payment(order, message_id="other"), consumer="payments")
    assert started == ["process payments"]
