"""The vendors' contract, held against the database of the leg that runs it: what each
:class:`~idempotent_orders.vendors.Vendor` says its database does, the database does."""

from __future__ import annotations

import threading

import pytest
from django.db import DatabaseError, IntegrityError, OperationalError, connection, transaction
from django.test.utils import CaptureQueriesContext

from idempotent_orders.consuming.failures import is_retryable
from idempotent_orders.models import OutboxMessage
from idempotent_orders.vendors import VENDORS, Vendor, vendor

pytestmark = pytest.mark.django_db


def test_the_vendor_is_chosen_once_and_is_the_databases() -> None:
    chosen = vendor()
    assert chosen is vendor(connection)
    assert chosen.name == connection.vendor
    assert type(chosen) is not Vendor, f"{connection.vendor} has a vendor of its own"
    assert set(VENDORS) == {"postgresql", "mysql", "sqlite"}


_WRITTEN = [
    f for f in OutboxMessage._meta.concrete_fields if not f.primary_key and not f.has_db_default()
]


def _insert() -> tuple[str, str]:
    """An outbox row's columns and placeholders, for an INSERT of our own."""
    return ", ".join(_column(f.name) for f in _WRITTEN), ", ".join(["%s"] * len(_WRITTEN))


def _params(message_id: str) -> list[object]:
    sample = OutboxMessage(message_id=message_id, task_name="t", payload={})
    return [f.get_db_prep_save(f.pre_save(sample, True), connection) for f in _WRITTEN]


def _row(message_id: str) -> OutboxMessage:
    return OutboxMessage.objects.create(message_id=message_id, task_name="t", payload={})


def _table() -> str:
    return connection.ops.quote_name(OutboxMessage._meta.db_table)


def _column(name: str) -> str:
    return connection.ops.quote_name(str(OutboxMessage._meta.get_field(name).column))


def test_several_statements_go_in_one_text_where_the_vendor_says() -> None:
    if not vendor().several_statements(connection):
        with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT 1; SELECT 2")
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1; SELECT 2")
        first = cursor.fetchone()[0]
        cursor.nextset()
        second = cursor.fetchone()[0]
    assert (first, second) == (1, 2)


def test_returning_gives_the_rows_inserted_and_none_a_duplicate_skipped() -> None:
    chosen = vendor()
    row = _row("kept")
    head, values = _insert()
    head, tail = chosen.insert_ignoring(_table(), head, _column("message_id"))
    sql = f"{head} VALUES ({values}) {tail} RETURNING {_column('id')}"

    if not chosen.returns_inserted(connection):
        with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql, _params("new"))
        return
    with connection.cursor() as cursor:
        cursor.execute(sql, _params("kept"))
        again = list(cursor.fetchall())
        cursor.execute(sql, _params("new"))
        new = list(cursor.fetchall())
    assert again == []
    assert new == [(OutboxMessage.objects.get(message_id="new").pk,)]
    assert OutboxMessage.objects.get(message_id="kept").pk == row.pk


def test_returning_gives_the_rows_updated_where_the_vendor_says() -> None:
    chosen = vendor()
    rows = [_row(f"u-{n}") for n in range(3)]
    sql = (
        f"UPDATE {_table()} SET {_column('task_name')} = 'u' WHERE {_column('id')} IN (%s, %s)"
        f" RETURNING {_column('id')}"
    )
    if chosen.returns_updated(connection):
        with connection.cursor() as cursor:
            cursor.execute(sql, [rows[0].pk, rows[2].pk])
            assert sorted(r[0] for r in cursor.fetchall()) == [rows[0].pk, rows[2].pk]
    else:
        with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql, [rows[0].pk, rows[2].pk])


def test_a_select_of_no_table_may_have_a_where_and_an_empty_json_list() -> None:
    chosen = vendor()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT 7, {chosen.empty_json_list}{chosen.no_table} WHERE 1 = %s", [1])
        seven, empty = cursor.fetchone()
    assert seven == 7
    assert empty in ([], "[]")


def test_an_error_aborts_the_transaction_where_the_vendor_says() -> None:
    _row("twice")
    with transaction.atomic():
        columns, values = _insert()
        # Django's own cursor: the ORM would mark the block for rollback itself.
        with pytest.raises(IntegrityError), connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {_table()} ({columns}) VALUES ({values})", _params("twice")
            )
        try:
            with connection.cursor() as cursor:
                cursor.execute(f"SELECT COUNT(*) FROM {_table()}")
                assert cursor.fetchone()[0] == 1
            aborted = False
        except DatabaseError:
            aborted = True
        transaction.set_rollback(True)
    assert aborted is vendor().error_aborts_transaction


def test_the_planner_estimates_rows_where_the_vendor_has_one() -> None:
    for n in range(5):
        _row(f"e-{n}")
    sql, params = OutboxMessage.objects.values("pk").query.sql_with_params()
    estimate = vendor().estimated_rows(connection, sql, params)
    if connection.vendor == "postgresql":
        assert isinstance(estimate, int)
        assert estimate >= 1
    else:
        assert estimate is None


def test_a_failed_estimate_leaves_the_transaction_usable() -> None:
    with transaction.atomic():
        estimate = vendor().estimated_rows(connection, "SELECT no_such_column FROM no_table", [])
        assert OutboxMessage.objects.count() == 0  # the transaction still answers
    assert estimate is None


def test_a_lock_until_commit_keeps_another_session_out_where_the_vendor_has_one() -> None:
    chosen = vendor()
    with transaction.atomic(), CaptureQueriesContext(connection) as sent:
        chosen.lock_until_commit(connection, 4242)
        if chosen.claim_lock != "advisory":
            # No such lock: the claims are kept apart otherwise, and nothing is sent.
            assert sent.captured_queries == []
            return
        other = connection.copy()
        try:
            with other.cursor() as cursor:
                cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [4242])
                taken_elsewhere = cursor.fetchone()[0]
        finally:
            other.close()
    assert taken_elsewhere is False


@pytest.mark.django_db(transaction=True)
def test_a_relaxed_commit_is_this_transactions_alone() -> None:
    with transaction.atomic(), CaptureQueriesContext(connection) as sent:
        vendor().relax_commit(connection)
        if connection.vendor != "postgresql":
            assert sent.captured_queries == []  # the commit is as the database makes it
            return
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            assert cursor.fetchone()[0] == "off"
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] == "on"


@pytest.mark.django_db(transaction=True)
def test_a_deadlock_is_said_to_be_rolled_back_and_a_refused_row_is_not() -> None:
    chosen = vendor()
    _row("a"), _row("b")
    with pytest.raises(IntegrityError) as refused, transaction.atomic():
        _row("a")
    assert not chosen.rolled_back(refused.value)
    assert not is_retryable(refused.value)
    if chosen.name == "sqlite":
        # One writer at a time: a second one waits for the first, no deadlock arises.
        assert not chosen.rolled_back(OperationalError("database is locked"))
        return
    # Two sessions each lock one row, then ask for the other's: the database rolls one
    # of them back.
    both_locked = threading.Barrier(2, timeout=30)
    errors: list[Exception] = []

    def cross(first: str, second: str) -> None:
        try:
            with transaction.atomic():
                OutboxMessage.objects.filter(message_id=first).update(task_name="x")
                both_locked.wait()
                OutboxMessage.objects.filter(message_id=second).update(task_name="x")
        except OperationalError as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=cross, args=pair) for pair in (("a", "b"), ("b", "a"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(errors) == 1, errors
    assert chosen.rolled_back(errors[0]), errors[0]
    assert is_retryable(errors[0])
    # The survivor committed: both rows carry its writes.
    assert set(OutboxMessage.objects.values_list("task_name", flat=True)) == {"x"}


def test_a_cursor_skips_the_results_of_a_texts_first_statements_where_it_takes_several() -> None:
    chosen = vendor()
    with connection.cursor() as cursor:
        if not chosen.several_statements(connection):
            assert not chosen.takes_several(cursor.cursor)
            return
        assert chosen.takes_several(cursor.cursor)
        cursor.execute("SELECT 1; SELECT 2; SELECT 3")
        chosen.skip_results(cursor.cursor, 2)
        assert [tuple(row) for row in cursor.fetchall()] == [(3,)]
    if connection.features.can_use_chunked_reads and chosen.name == "postgresql":
        # A server-side cursor declares its one query.
        named = connection.chunked_cursor()
        try:
            assert not chosen.takes_several(named.cursor)
        finally:
            named.close()
