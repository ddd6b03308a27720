"""The backend contract, held against the database of the leg that runs it: what each
backend says of its database is what the database does."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, OperationalError, connection
from django.utils import timezone

from idempotent_orders.consuming.backends import BACKENDS, Backend, backend
from idempotent_orders.models import ProcessedMessage
from idempotent_orders.vendors import vendor

pytestmark = pytest.mark.django_db


def test_the_backend_is_chosen_once_per_vendor_and_is_the_vendors() -> None:
    chosen = backend()
    assert chosen is backend(connection)
    assert chosen.name == connection.vendor
    assert isinstance(chosen, type(vendor()))
    assert type(chosen) is not Backend, f"{connection.vendor} has a backend of its own"
    assert set(BACKENDS) == {"postgresql", "mysql", "sqlite"}


def test_the_roads_without_a_read_are_functions_of_the_road() -> None:
    roads = backend().roads_without_read()
    assert len(roads) == len(backend().without_read) >= 1
    assert all(callable(road) for road in roads)


def _inbox(message_id: str) -> list[object]:
    return ["payments", message_id, connection.ops.adapt_datetimefield_value(timezone.now())]


def test_the_insert_that_skips_duplicates_skips_them_and_inserts_the_rest() -> None:
    qn = connection.ops.quote_name
    meta = ProcessedMessage._meta
    columns = ", ".join(
        qn(str(meta.get_field(n).column))  # type: ignore[union-attr]
        for n in (
            "consumer",
            "message_id",
            "message_type",
            "status",
            "outcome",
            "attempts",
            "error",
            "body",
            "updated_at",
        )
    )
    conflict = ", ".join(
        qn(str(meta.get_field(n).column))  # type: ignore[union-attr]
        for n in ("consumer", "message_id")
    )
    head, tail = backend().insert_ignoring(qn(meta.db_table), columns, conflict)
    sql = f"{head} VALUES (%s, %s, '', 'processed', 'applied', 1, '', '', %s) {tail}"
    with connection.cursor() as cursor:
        cursor.execute(sql, _inbox("m-1"))
        first = cursor.rowcount
        cursor.execute(sql, _inbox("m-1"))
        again = cursor.rowcount
        cursor.execute(sql, _inbox("m-2"))
        other = cursor.rowcount
    assert (first, again, other) == (1, 0, 1)
    assert ProcessedMessage.objects.filter(consumer="payments").count() == 2


def test_the_bytewise_comparison_tells_case_and_accents_apart() -> None:
    ProcessedMessage.objects.create(consumer="payments", message_id="Abc-é", status="processed")
    qn = connection.ops.quote_name
    column = qn(str(ProcessedMessage._meta.get_field("message_id").column))
    table = qn(ProcessedMessage._meta.db_table)
    found = {}
    with connection.cursor() as cursor:
        for probe in ("Abc-é", "abc-é", "Abc-e", "ABC-É"):
            cursor.execute(
                f"SELECT COUNT(*) FROM {table} WHERE {backend().bytewise(column)}", [probe]
            )
            found[probe] = cursor.fetchone()[0]
    assert found == {"Abc-é": 1, "abc-é": 0, "Abc-e": 0, "ABC-É": 0}


def test_nulls_sort_where_the_backend_says() -> None:
    ProcessedMessage.objects.create(consumer="payments", message_id="n-1", seq=None)
    ProcessedMessage.objects.create(consumer="payments", message_id="n-2", seq=5)
    first = ProcessedMessage.objects.order_by("seq").values_list("seq", flat=True)[0]
    assert (first == 5) is backend().nulls_last


class _DriverError(Exception):
    """The driver's error Django wraps, with the SQLSTATE the server sent (or None)."""

    def __init__(self, sqlstate: str | None) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


def _caused_by(sqlstate: str | None) -> OperationalError:
    error = OperationalError("the server said")
    error.__cause__ = _DriverError(sqlstate)
    return error


def test_only_a_lost_connection_is_said_to_be_lost() -> None:
    lost = backend().connection_lost
    assert not lost(IntegrityError("duplicate key"))
    assert not lost(ValueError("not a database error"))
    if connection.vendor == "mysql":
        assert lost(OperationalError(2006, "MySQL server has gone away"))
        assert lost(OperationalError(2013, "Lost connection to server during query"))
        assert not lost(OperationalError(1213, "Deadlock found"))
    elif connection.vendor == "postgresql":
        assert lost(_caused_by("08006"))  # connection failure
        assert lost(_caused_by("57P01"))  # the server shut down
        assert lost(_caused_by(None))  # the client's own error: no answer came
        assert not lost(_caused_by("40001"))  # a serialization failure rolled back
        assert not lost(_caused_by("40P01"))  # a deadlock rolled back
    else:
        # SQLite has no connection to lose: an error there never hides a commit.
        assert not lost(OperationalError("database is locked"))
