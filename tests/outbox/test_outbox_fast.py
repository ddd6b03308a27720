"""The relay's templated publish sends the message ``apply_async`` would, and a worker runs it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import current_app, signals
from django.db import transaction
from django.test import override_settings

from demo_project.models import LoyaltyAccount
from demo_project.tasks import award_points
from idempotent_orders.models import OutboxMessage, OutboxStatus
from idempotent_orders.outbox import publish_on_commit, relay_outbox
from idempotent_orders.outbox.sender import _TemplateSender
from tests.support.services import wait_until

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
NO_IMMEDIATE = {"OUTBOX_PUBLISH_ON_COMMIT": False}


class Recorder:
    """A producer that records each publish Celery (or the fast path) asks of it."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.published: list[tuple[Any, dict[str, Any]]] = []

    def publish(self, body: Any, **kwargs: Any) -> None:
        self.published.append((body, kwargs))


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    with current_app.connection_for_write() as connection:
        yield Recorder(connection)


@pytest.fixture
def routes() -> Iterator[None]:
    """The app's task routes send award_points to its own queue (a glob route)."""
    before = current_app.conf.task_routes
    current_app.conf.task_routes = {"demo_project.*": {"queue": "routed-points"}}
    current_app.amqp.flush_routes()
    current_app.amqp.__dict__.pop("router", None)  # a cached property
    yield
    current_app.conf.task_routes = before
    current_app.amqp.flush_routes()
    current_app.amqp.__dict__.pop("router", None)


def row(options: dict[str, Any], **fields: Any) -> OutboxMessage:
    mid = f"out-{uuid.uuid4().hex}"
    return OutboxMessage(
        message_id=mid,
        task_name=award_points.name,
        payload={"message_id": mid, "customer": "erin", "points": 5, "note": "café"},
        options=options,
        **fields,
    )


def by_apply_async(recorder: Recorder, message: OutboxMessage) -> tuple[Any, dict[str, Any]]:
    """What Celery itself publishes for the row (as the general path calls it)."""
    options = dict(message.options)
    trace = {"traceparent": message.traceparent, "x-correlation-id": message.correlation_id}
    trace = {k: v for k, v in trace.items() if v}
    if trace:
        options["headers"] = {**options.get("headers", {}), **trace}
    award_points.apply_async(
        args=(message.payload,), task_id=message.message_id, producer=recorder, **options
    )
    return recorder.published.pop()


CASES = [
    pytest.param({}, {}, id="defaults"),
    pytest.param(
        {"queue": "points-x", "priority": 7, "headers": {"x-tenant": "t1"}},
        {"traceparent": TP, "correlation_id": "checkout-9"},
        id="queue-priority-headers-trace",
    ),
    pytest.param({"time_limit": 30, "soft_time_limit": 20}, {}, id="time-limits"),
    pytest.param({"exchange": "points-ex", "routing_key": "pts.a"}, {}, id="exchange"),
]


@pytest.mark.parametrize(("options", "fields"), CASES)
def test_the_fast_path_publishes_what_apply_async_publishes(
    recorder: Recorder, options: dict[str, Any], fields: dict[str, Any]
) -> None:
    first, second = row(options, **fields), row(options, **fields)
    fast = _TemplateSender(recorder)
    assert fast.send(first)
    assert fast.send(second)
    ours = recorder.published[:]
    recorder.published.clear()
    for message, (body, kwargs) in zip((first, second), ours, strict=True):
        expected_body, expected = by_apply_async(recorder, message)
        assert body == expected_body
        assert kwargs["headers"] == expected["headers"]
        assert kwargs["headers"]["id"] == kwargs["headers"]["root_id"] == message.message_id
        if message is second:  # the queue was declared by the batch's first publish
            assert kwargs["declare"] is None
            kwargs["declare"] = expected["declare"]
        assert kwargs == expected


def test_the_app_routes_and_the_tasks_options_are_kept(recorder: Recorder, routes: None) -> None:
    message = row({})
    assert _TemplateSender(recorder).send(message)
    (body, kwargs), expected = recorder.published.pop(), by_apply_async(recorder, message)
    assert (body, kwargs) == expected
    assert kwargs["routing_key"] == "routed-points"


def test_a_long_argsrepr_is_cut_to_celerys_size(recorder: Recorder) -> None:
    message = row({})
    message.payload = {**message.payload, "note": "x" * 5000}
    assert _TemplateSender(recorder).send(message)
    headers = recorder.published.pop()[1]["headers"]
    expected = by_apply_async(recorder, message)[1]["headers"]
    # Celery ends its cut with the closing brackets; both are about 1 KiB, alike up to the cut.
    assert len(headers["argsrepr"]) == 1024 <= len(expected["argsrepr"]) <= 1100
    assert headers["argsrepr"][:1000] == expected["argsrepr"][:1000]
    assert headers["argsrepr"].endswith("...")


@pytest.mark.parametrize(
    "options",
    [{"countdown": 10}, {"expires": 60}, {"serializer": "pickle"}, {"link": None}],
    ids=["countdown", "expires", "serializer", "link"],
)
def test_options_it_does_not_handle_take_apply_async(
    recorder: Recorder, options: dict[str, Any]
) -> None:
    assert not _TemplateSender(recorder).send(row(options))
    assert recorder.published == []


def test_publish_signal_receivers_or_a_patched_task_take_apply_async(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    def receiver(**kwargs: Any) -> None:
        pass

    signals.before_task_publish.connect(receiver)
    try:
        assert not _TemplateSender(recorder).send(row({}))
    finally:
        signals.before_task_publish.disconnect(receiver)
    monkeypatch.setattr(award_points, "apply_async", lambda **kw: None)
    assert not _TemplateSender(recorder).send(row({}))
    assert recorder.published == []


@pytest.mark.django_db
@override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE)
def test_the_relay_mixes_both_paths_in_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-memory broker: fast rows and a countdown row (apply_async) in one batch."""
    from idempotent_orders.outbox import sender

    general: list[str] = []
    send = sender._send

    def counting(message: OutboxMessage) -> None:
        general.append(message.message_id)
        send(message)

    monkeypatch.setattr(sender, "_send", counting)
    fast = [
        publish_on_commit(
            award_points, {"message_id": uuid.uuid4().hex, "customer": "a", "points": 1}
        )
        for _ in range(4)
    ]
    slow = publish_on_commit(
        award_points, {"message_id": uuid.uuid4().hex, "customer": "a", "points": 1}, countdown=5
    )
    assert relay_outbox(batch_size=10).published == 5
    assert general == [slow.message_id]
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == len(fast) + 1


@pytest.mark.services
@pytest.mark.workers
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_real_worker_runs_the_fast_path_messages(celery_workers: Any, broker: str) -> None:
    celery_workers(broker, processes=1, concurrency=2)
    customer = f"fast-{uuid.uuid4().hex[:8]}"
    with override_settings(IDEMPOTENT_ORDERS=NO_IMMEDIATE), transaction.atomic():
        for _ in range(20):
            publish_on_commit(
                award_points,
                {"message_id": uuid.uuid4().hex, "customer": customer, "points": 2},
                priority=1,
            )
    assert relay_outbox(batch_size=50).published == 20

    def points() -> int:
        account = LoyaltyAccount.objects.filter(customer=customer).first()
        return account.points if account else 0

    assert wait_until(lambda: points() == 40, timeout=90), points()


def test_the_publisher_threads_kept_template_is_reused_yet_a_patched_task_wins(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[str] = []
    template = _TemplateSender._template

    def counting(self: _TemplateSender, message: OutboxMessage) -> Any:
        taken.append(message.message_id)
        return template(self, message)

    monkeypatch.setattr(_TemplateSender, "_template", counting)
    cache: dict[Any, Any] = {}
    first, second = row({}), row({})
    assert _TemplateSender(recorder, cache).send(first)
    assert _TemplateSender(recorder, cache).send(second)  # the next batch
    assert taken == [first.message_id]
    assert recorder.published[1][1]["declare"] == recorder.published[0][1]["declare"]
    assert recorder.published[1][1]["headers"]["id"] == second.message_id
    monkeypatch.setattr(award_points, "apply_async", lambda **kw: None)
    assert not _TemplateSender(recorder, cache).send(row({}))


def test_the_publisher_thread_reads_the_apps_settings_once_a_template_ttl(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eager mode switched on at run time: a batch without the thread's cache sees it at
    once, the publisher thread's next batches once its reading is :data:`TEMPLATE_TTL`
    old, as for the templates."""
    from idempotent_orders.outbox import sender

    clock = [1000.0]
    monkeypatch.setattr(sender, "_monotonic", lambda: clock[0])
    read: list[bool] = []
    settings_allow = _TemplateSender._settings_allow

    def counting(app: Any) -> bool:
        read.append(settings_allow(app))
        return read[-1]

    monkeypatch.setattr(_TemplateSender, "_settings_allow", staticmethod(counting))
    cache: dict[Any, Any] = {}
    assert _TemplateSender(recorder, cache).send(row({}))
    before = current_app.conf.task_always_eager
    current_app.conf.task_always_eager = True
    try:
        assert _TemplateSender(recorder, cache).send(row({}))  # the thread's reading, kept
        assert not _TemplateSender(recorder).send(row({}))  # no cache: read now
        clock[0] += sender.TEMPLATE_TTL
        assert not _TemplateSender(recorder, cache).send(row({}))  # read again
    finally:
        current_app.conf.task_always_eager = before
    assert read == [True, False, False]


@pytest.mark.parametrize("options", [{}, {"queue": "q", "priority": 3}])
def test_the_options_key_is_the_options_as_sorted_json(options: dict[str, Any]) -> None:
    import json

    from idempotent_orders.outbox.sender import _options_key

    assert _options_key(options) == json.dumps(options, sort_keys=True, default=str)


def test_a_task_not_registered_here_publishes_what_send_task_publishes(
    recorder: Recorder,
) -> None:
    """A relay process that does not import the tasks: Celery's send_task message."""
    message = row({"queue": "remote-q"})
    message.task_name = "remote.only_registered_in_the_worker"
    assert _TemplateSender(recorder).send(message)
    ours = recorder.published.pop()
    current_app.send_task(
        message.task_name,
        args=(message.payload,),
        task_id=message.message_id,
        producer=recorder,
        queue="remote-q",
    )
    assert ours == recorder.published.pop()
    assert ours[1]["headers"]["task"] == "remote.only_registered_in_the_worker"
