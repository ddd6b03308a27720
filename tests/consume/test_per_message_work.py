"""What the consume road does once instead of once per message keeps every message right:
the guarded UPDATE kept per shape and sent where nothing watches on the driver's cursor
(and through Django's where something does), the trace context read only where there
is one, the outbox's column limits read once, the backend's texts looked up once."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.db import connection
from django.db.models.signals import post_save
from django.test.utils import CaptureQueriesContext, override_settings

from idempotent_orders import get_order_model, models, tracing
from idempotent_orders.consuming import sql
from idempotent_orders.consuming.backends import Backend
from idempotent_orders.consuming.running import road
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import SAVE_GUARD, Outcome
from idempotent_orders.outbox import producer
from tests.support.messages import payment

pytestmark = pytest.mark.django_db(transaction=True)


def _saved(sender: Any, **kwargs: Any) -> None:
    """A ``post_save`` receiver: puts the order model on the save() road."""


@pytest.fixture
def save_road() -> Any:
    model = get_order_model()
    post_save.connect(_saved, sender=model, weak=False, dispatch_uid="tests.per_message_work")
    try:
        assert road(model, "pay")[0] == "save"
        yield model
    finally:
        post_save.disconnect(sender=model, dispatch_uid="tests.per_message_work")


def _updates_of(statements: list[str], model: Any) -> list[str]:
    table = connection.ops.quote_name(model._meta.db_table)
    return [s for s in statements if s.lstrip().startswith(f"UPDATE {table} ")]


def test_an_execute_wrapper_sees_the_guarded_update_of_save(make_order, save_road) -> None:
    """Where an execute wrapper is installed, the UPDATE ``save()`` sends goes through
    Django's cursor: the wrapper sees it, with its guard, and the message is applied."""
    consume_message(payment(make_order()), consumer="payments")  # the first one's work
    order = make_order()
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    updates = _updates_of(seen, save_road)
    assert len(updates) == 1, seen
    assert connection.ops.quote_name("version") in updates[0].split(" WHERE ", 1)[1]
    order.refresh_from_db()
    assert (order.version, order.payment_id) == (1, f"pay-{order.pk}")


def test_query_logging_sees_the_guarded_update_of_save(make_order, save_road) -> None:
    consume_message(payment(make_order()), consumer="payments")
    order = make_order()
    with CaptureQueriesContext(connection) as captured:
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    assert len(_updates_of([q["sql"] for q in captured.captured_queries], save_road)) == 1


def test_a_patched_cursor_sees_the_guarded_update_of_save(make_order, save_road) -> None:
    """Error trackers and APM agents patch ``CursorWrapper.execute`` instead of installing
    an execute wrapper: then the road sends its statements through Django's cursor too."""
    from django.db.backends.utils import CursorWrapper

    consume_message(payment(make_order()), consumer="payments")
    order = make_order()
    seen: list[str] = []
    original = CursorWrapper.execute

    def patched_execute(self: Any, sql: str, params: Any = None) -> Any:
        seen.append(sql)
        return original(self, sql, params)

    with mock.patch.object(CursorWrapper, "execute", patched_execute):
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    assert len(_updates_of(seen, save_road)) == 1, seen
    order.refresh_from_db()
    assert (order.version, order.payment_id) == (1, f"pay-{order.pk}")


@pytest.mark.backends("postgresql")
def test_unwatched_the_guarded_update_goes_to_the_drivers_cursor(make_order, save_road) -> None:
    consume_message(payment(make_order()), consumer="payments")
    order = make_order()
    served: list[bool] = []
    real = models.driver_cursor

    def spy(conn: Any, **kwargs: Any) -> Any:
        cursor = real(conn, **kwargs)
        served.append(cursor is not None)
        return cursor

    with mock.patch.object(models, "driver_cursor", spy):
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    assert served == [True]
    order.refresh_from_db()
    assert (order.version, order.payment_id) == (1, f"pay-{order.pk}")


def test_each_shape_of_guarded_update_has_its_own_statement(make_order) -> None:
    """Two saves that write different fields, under the same guard: each is sent the
    statement of its own shape (kept for the next save of that shape), and writes only
    its own fields."""
    order = make_order()
    other = make_order()
    statements: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        statements.append(sql)
        return execute(sql, params, many, context)

    model = type(order)
    for _round in range(2):  # the second round takes the statements kept by the first
        for instance in (order, other):
            instance.refresh_from_db()
            version = instance.version
            instance.last_seq += 1
            instance.has_parked = not instance.has_parked
            instance.__dict__[SAVE_GUARD] = {"version": version}
            instance.version = version + 1
            instance.save(update_fields=["last_seq", "version"])
            instance.__dict__[SAVE_GUARD] = {"version": version + 1}
            instance.version = version + 2
            with connection.execute_wrapper(wrapper):
                instance.save(update_fields=["has_parked", "version"])
    quote = connection.ops.quote_name
    sets = [s.split(" SET ", 1)[1].split(" WHERE ", 1)[0] for s in _updates_of(statements, model)]
    assert len(sets) == 4
    assert all(quote("has_parked") in s and quote("last_seq") not in s for s in sets), sets
    for instance in (order, other):
        row = model._default_manager.values("last_seq", "has_parked", "version").get(pk=instance.pk)
        assert row == {"last_seq": 2, "has_parked": False, "version": 4}


def test_a_guard_that_no_longer_matches_raises_order_changed(make_order) -> None:
    from idempotent_orders.exceptions import OrderChanged

    order = make_order()
    order.__dict__[SAVE_GUARD] = {"version": 7}
    order.last_seq = 5
    with pytest.raises(OrderChanged):
        order.save(update_fields=["last_seq"])
    order.refresh_from_db()
    assert order.last_seq == 0


def test_the_backends_texts_are_looked_up_once_a_message(make_order, save_road) -> None:
    consume_message(payment(make_order()), consumer="payments")
    order = make_order()
    real = Backend.texts
    calls: list[Any] = []

    def counted(self: Backend) -> Any:
        calls.append(self)
        return real(self)

    with mock.patch.object(Backend, "texts", counted):
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    # SQLite's save() road sends no texts; PostgreSQL's and MariaDB's look them up once.
    assert len(calls) == (0 if connection.vendor == "sqlite" else 1)


def test_no_trace_is_the_one_empty_context_and_runs_no_propagator() -> None:
    with mock.patch.object(tracing, "_otel_inject") as inject:
        assert tracing.current() is tracing._EMPTY
        assert not tracing.current()
    inject.assert_not_called()


def test_an_active_span_is_carried_into_the_outbox_row() -> None:
    """With a valid current span the follow-up's row carries its ``traceparent``."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import use_span

    tracer = TracerProvider().get_tracer("tests")
    span = tracer.start_span("consume")
    context = span.get_span_context()
    expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    with use_span(span, end_on_exit=True):
        row = producer.outbox_row("idempotent_orders.fulfil_order", 1, message_id="m-1")
        with tracing.use(correlation_id="c-1"):
            assert tracing.current() == tracing.TraceContext(expected, "c-1")
    assert row["traceparent"] == expected
    assert producer.outbox_row("t", 1, message_id="m-2")["traceparent"] == ""


def test_a_celery_tasks_headers_are_read_while_it_runs() -> None:
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    task = mock.Mock()
    task.request = mock.Mock(spec=["headers"], headers={"traceparent": tp})
    with mock.patch.object(tracing, "_current_task", task):
        assert tracing.carried() == tracing.TraceContext(tp, "")
    task.request = None
    with mock.patch.object(tracing, "_current_task", task):
        assert tracing.carried() is tracing._EMPTY


def test_a_value_longer_than_its_outbox_column_is_not_handed_over() -> None:
    fields = producer.outbox_row("idempotent_orders.fulfil_order", 1, message_id="m-1")
    assert sql.handed_over(fields)
    assert not sql.handed_over({**fields, "message_id": "m" * 10_000})
    assert not sql.handed_over({**fields, "correlation_id": 5})
    assert not sql.handed_over({k: v for k, v in fields.items() if k != "options"})


@pytest.mark.backends("postgresql", "mysql")
def test_the_save_road_with_its_follow_up_applies_on_the_texts(make_order, save_road) -> None:
    config = {**settings.IDEMPOTENT_ORDERS, "FULFIL_AFTER_PAYMENT": True}
    with override_settings(IDEMPOTENT_ORDERS=config):
        consume_message(payment(make_order()), consumer="payments")
        order = make_order()
        assert consume_message(payment(order), consumer="payments") is Outcome.APPLIED
    order.refresh_from_db()
    assert order.version == 1


def test_a_kept_setting_is_read_again_after_settings_change() -> None:
    from idempotent_orders.conf import conf

    before = conf.CONFLICT_RETRIES
    assert before == conf.CONFLICT_RETRIES  # kept
    with override_settings(
        IDEMPOTENT_ORDERS={**settings.IDEMPOTENT_ORDERS, "CONFLICT_RETRIES": 77}
    ):
        assert conf.CONFLICT_RETRIES == 77
    assert before == conf.CONFLICT_RETRIES


def test_a_list_setting_is_built_afresh_for_every_reader() -> None:
    from idempotent_orders.conf import conf

    headers = conf.REPLAY_HEADERS
    headers.append("x-changed-by-a-reader")
    assert "x-changed-by-a-reader" not in conf.REPLAY_HEADERS


@pytest.mark.parametrize(
    ("guard", "applies"),
    [
        ({"version": 0, "last_seq__in": [0, 1]}, True),  # kept per shape: IN of two
        ({"version": 0, "last_seq__in": [0, None]}, True),  # NULL in the list: Django's query
        ({"version": 0, "has_parked": None}, False),  # IS NULL: Django's query, no match
        ({"version": 1, "last_seq": 0}, False),  # kept per shape, no match
    ],
)
def test_every_guard_is_written_by_the_statement_that_spells_it(
    make_order, guard: dict[str, Any], applies: bool
) -> None:
    from idempotent_orders.exceptions import OrderChanged

    order = make_order()
    order.__dict__[SAVE_GUARD] = dict(guard)
    order.last_seq = 3
    if applies:
        order.save(update_fields=["last_seq"])
    else:
        with pytest.raises(OrderChanged):
            order.save(update_fields=["last_seq"])
    order.refresh_from_db()
    assert order.last_seq == (3 if applies else 0)
