"""The inbox partitioned by day on PostgreSQL: one claim across partitions, retention by DROP.

Every road's claim is raced here against a first copy of the message that sits in
another partition, committed or still in flight; retention drops a partition
while consumers run. Run the other consume tests against a partitioned inbox with
``IO_TEST_PARTITIONED_INBOX=1`` (tests/conftest.py converts the test database).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.management import call_command
from django.db import IntegrityError, close_old_connections, connection, transaction
from django.utils import timezone

from idempotent_orders.checks import partitioning as partition_checks
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import InboxStatus, OrderStatus, Outcome, ProcessedMessage
from idempotent_orders.partitioning import (
    convert,
    is_partitioned,
    maintain,
    partitions,
    period_start,
    revert,
)
from idempotent_orders.retention import purge, purgeable
from tests.support.messages import payment, shipment

pytestmark = [pytest.mark.backends("postgresql"), pytest.mark.django_db(transaction=True)]

TABLE = ProcessedMessage._meta.db_table


@pytest.fixture
def partitioned(settings: Any) -> Iterator[None]:
    settings.IDEMPOTENT_ORDERS = {**settings.IDEMPOTENT_ORDERS, "INBOX_PARTITION_DAYS": 1}
    already = is_partitioned()
    convert()
    yield
    if not already:  # a run with IO_TEST_PARTITIONED_INBOX=1 keeps its partitioned inbox
        revert()


def partition_of(message_id: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT tableoid::regclass::text FROM {TABLE} WHERE message_id = %s", [message_id]
        )
        return str(cursor.fetchone()[0])


def first_copy(message: dict[str, Any], consumer: str, *, days_ago: float = 1) -> None:
    """The message's inbox row as a delivery ``days_ago`` left it (its order untouched)."""
    ProcessedMessage.objects.create(
        consumer=consumer,
        message_id=message["message_id"],
        message_type=message["type"],
        status=InboxStatus.DONE,
        outcome=Outcome.APPLIED,
        created_at=timezone.now() - timedelta(days=days_ago),
    )


def in_transaction(message: dict[str, Any], consumer: str) -> Outcome:
    # Inside a caller's transaction the one-statement road is not taken: the read,
    # decide, write road claims with its own INSERT.
    with transaction.atomic():
        return consume_message(message, consumer=consumer)


def batch(message: dict[str, Any], consumer: str) -> Outcome:
    (outcome,) = consume_batch([message], consumer=consumer)
    return outcome


ROADS: dict[str, Callable[[dict[str, Any], str], Outcome]] = {
    "one statement": lambda message, consumer: consume_message(message, consumer=consumer),
    "read, decide, write": in_transaction,
    "batch": batch,
}


def test_convert_partitions_by_day_and_revert_keeps_every_row(partitioned, make_order) -> None:
    order = make_order()
    consume_message(payment(order, message_id="kept"), consumer="payments")
    listed = partitions()
    assert listed[0].start is None  # the default partition: rows retention keeps
    today = period_start(timezone.now(), 1)
    assert [p.start for p in listed[1:]][-4:] == [today + timedelta(days=n) for n in range(4)]
    assert partition_of("kept") == f"{TABLE}_{today:%Y%m%d}"
    before = list(ProcessedMessage.objects.values_list("pk", "message_id", "created_at"))

    revert()
    assert not is_partitioned()
    assert list(ProcessedMessage.objects.values_list("pk", "message_id", "created_at")) == before
    with pytest.raises(IntegrityError), transaction.atomic():
        first_copy(payment(order, message_id="kept"), "payments", days_ago=3)
    # New rows take ids after the copied ones.
    assert consume_message(payment(make_order()), consumer="payments") == Outcome.APPLIED
    assert ProcessedMessage.objects.latest("pk").pk > before[0][0]
    convert()
    assert is_partitioned()


@pytest.mark.parametrize("road", sorted(ROADS))
def test_a_message_first_seen_in_an_earlier_partition_is_a_duplicate(
    partitioned, make_order, road: str
) -> None:
    order = make_order()
    message = payment(order)
    first_copy(message, "payments")
    assert partition_of(message["message_id"]) != f"{TABLE}_{timezone.now():%Y%m%d}"

    assert ROADS[road](message, "payments") == Outcome.DUPLICATE
    order.refresh_from_db()
    assert (order.status, order.version) == (OrderStatus.PENDING_PAYMENT, 0)
    assert ProcessedMessage.objects.filter(message_id=message["message_id"]).count() == 1


def test_the_orm_road_raises_on_a_duplicate_in_another_partition(partitioned, make_order) -> None:
    # A shipment has no payment: in a transaction its claim is the ORM's own INSERT,
    # which meets the guard's unique_violation as it met the unique index.
    order = make_order()
    consume_message(payment(order), consumer="payments")
    message = shipment(order)
    first_copy(message, "shipping")
    assert in_transaction(message, "shipping") == Outcome.DUPLICATE
    order.refresh_from_db()
    assert order.status == OrderStatus.PAID
    with pytest.raises(IntegrityError), transaction.atomic():
        first_copy(message, "shipping", days_ago=0)


@pytest.mark.parametrize("commits", [True, False], ids=["rival commits", "rival rolls back"])
@pytest.mark.parametrize("road", sorted(ROADS))
def test_a_rival_in_flight_in_yesterdays_partition_is_waited_for(
    partitioned, make_order, road: str, commits: bool
) -> None:
    """The straddling race: the first copy's transaction began yesterday (its row goes to
    yesterday's partition), the second copy's today; no unique index sees both."""
    order = make_order()
    message = payment(order)
    inserted, outcomes = threading.Event(), []

    def rival() -> None:
        try:
            with transaction.atomic():
                first_copy(message, "payments")
                inserted.set()
                time.sleep(0.5)
                if not commits:
                    raise RuntimeError("rolled back")
        except RuntimeError:
            pass
        finally:
            connection.close()

    thread = threading.Thread(target=rival)
    thread.start()
    assert inserted.wait(10)
    started = time.monotonic()
    outcomes.append(ROADS[road](message, "payments"))
    waited = time.monotonic() - started
    thread.join()

    order.refresh_from_db()
    if commits:
        assert outcomes == [Outcome.DUPLICATE]
        assert order.status == OrderStatus.PENDING_PAYMENT
    else:
        assert outcomes == [Outcome.APPLIED]
        assert order.status == OrderStatus.PAID
    assert waited > 0.2  # it waited for the rival's lock rather than guessing
    assert ProcessedMessage.objects.filter(message_id=message["message_id"]).count() == 1


def test_concurrent_copies_across_the_boundary_apply_once(partitioned, make_order) -> None:
    """Threads race every road on the same messages; a copy of each also lands in
    yesterday's partition; each order moves once, each message has one inbox row."""
    orders = [make_order() for _ in range(24)]
    messages = [payment(order) for order in orders]
    results: list[tuple[str, Outcome | str]] = []
    lock = threading.Lock()
    start = threading.Barrier(5)

    def consumer(road: str, seed: int) -> None:
        shuffled = random.Random(seed).sample(messages, len(messages))
        start.wait()
        try:
            for message in shuffled:
                outcome = ROADS[road](message, "payments")
                with lock:
                    results.append((message["message_id"], outcome))
        finally:
            connection.close()

    def yesterday(seed: int) -> None:
        shuffled = random.Random(seed).sample(messages, len(messages))
        start.wait()
        try:
            for message in shuffled:
                try:
                    with transaction.atomic():
                        first_copy(message, "payments")
                except IntegrityError:
                    continue
                with lock:
                    results.append((message["message_id"], "yesterday"))
        finally:
            connection.close()

    threads = [
        threading.Thread(target=consumer, args=(road, n))
        for n, road in enumerate([*sorted(ROADS), "one statement"])
    ]
    threads.append(threading.Thread(target=yesterday, args=(99,)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    close_old_connections()

    firsts = Counter(mid for mid, outcome in results if outcome in (Outcome.APPLIED, "yesterday"))
    assert firsts == Counter(m["message_id"] for m in messages)  # once each, never twice
    assert {o for _, o in results} <= {Outcome.APPLIED, Outcome.DUPLICATE, "yesterday"}
    rows = Counter(ProcessedMessage.objects.values_list("message_id", flat=True))
    assert set(rows.values()) == {1}
    applied = {mid for mid, outcome in results if outcome == Outcome.APPLIED}
    for order, message in zip(orders, messages, strict=True):
        order.refresh_from_db()
        paid = message["message_id"] in applied
        assert (order.status, order.version) == (
            (OrderStatus.PAID, 1) if paid else (OrderStatus.PENDING_PAYMENT, 0)
        )


def test_retention_drops_old_partitions_while_consumers_run(partitioned, make_order) -> None:
    now = timezone.now()
    old = now - timedelta(days=10)
    cutoff = now - timedelta(days=7)
    maintain(now=old, cutoff=old - timedelta(days=30), kept=~purgeable(old))
    order = make_order()
    for n in range(50):
        first_copy(payment(order, message_id=f"old-{n}"), "payments", days_ago=10)
    keep = {
        "old-processing": {"status": InboxStatus.PROCESSING, "outcome": ""},
        "old-failed": {"status": InboxStatus.FAILED, "outcome": ""},
        "old-parked": {"status": InboxStatus.DONE, "outcome": Outcome.PARKED},
        "old-touched": {"status": InboxStatus.DONE, "outcome": Outcome.APPLIED},
    }
    for message_id, fields in keep.items():
        ProcessedMessage.objects.create(
            consumer="payments", message_id=message_id, created_at=old, **fields
        )
    ProcessedMessage.objects.filter(message_id="old-touched").update(updated_at=now)
    ProcessedMessage.objects.exclude(message_id="old-touched").update(updated_at=old)
    old_partitions = {p.name for p in partitions() if p.end is not None and p.end <= cutoff}
    assert partition_of("old-1") in old_partitions

    orders = [make_order() for _ in range(40)]
    messages = [payment(o) for o in orders]
    outcomes: list[tuple[str, Outcome]] = []
    errors: list[BaseException] = []
    running = threading.Event()

    def consume(seed: int) -> None:
        try:
            for n, message in enumerate(random.Random(seed).sample(messages, len(messages))):
                outcome = (ROADS["batch"] if n % 3 == 0 else ROADS["one statement"])(
                    message, "payments"
                )
                outcomes.append((message["message_id"], outcome))
                running.set()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=consume, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    assert running.wait(30)
    report = purge(now=now)
    for thread in threads:
        thread.join()
    close_old_connections()

    assert errors == []
    assert {p.name for p in partitions()} & old_partitions == set()
    assert report.inbox == 50
    left = set(
        ProcessedMessage.objects.filter(message_id__startswith="old-").values_list(
            "message_id", flat=True
        )
    )
    assert left == set(keep)
    assert {partition_of(m) for m in keep} == {f"{TABLE}_kept"}
    applied = Counter(mid for mid, outcome in outcomes if outcome == Outcome.APPLIED)
    assert applied == Counter(m["message_id"] for m in messages)
    assert ProcessedMessage.objects.filter(message_id__startswith="pay-msg-").count() == 40
    # A kept row that finishes later goes by the DELETE, as on a plain inbox.
    ProcessedMessage.objects.filter(message_id="old-failed").update(
        status=InboxStatus.REJECTED, updated_at=old
    )
    assert purge(now=now).inbox == 1


def test_maintain_creates_partitions_ahead_and_takes_rows_the_default_one_caught(
    partitioned, make_order
) -> None:
    later = timezone.now() + timedelta(days=20)
    first_copy(payment(make_order(), message_id="future"), "payments", days_ago=-20)
    assert partition_of("future") == f"{TABLE}_kept"
    report = maintain(now=later, cutoff=later - timedelta(days=400), kept=~purgeable(later))
    assert len(report.created) == 4
    assert report.dropped == []
    assert partition_of("future") == f"{TABLE}_{period_start(later, 1):%Y%m%d}"
    call_command("idempotent_orders_partitions", "status")


def _inbox_to(alias: str) -> Any:
    def db_for_write(model: Any, **hints: Any) -> str:
        return alias if model is ProcessedMessage else "default"

    return db_for_write


def test_checks_name_the_partitioned_inbox_misconfigurations(
    partitioned, settings, monkeypatch
) -> None:
    assert partition_checks.check_partitions(databases=["default"]) == []
    assert partition_checks.check_partitioned_inbox() == []
    # The inbox's database decides, not ``default``: routed to SQLite, E060; to PostgreSQL
    # while ``default`` is SQLite, none.
    for inbox, default, expected in (
        ("sqlite", "postgresql", ["idempotent_orders.E060"]),
        ("postgresql", "sqlite", []),
    ):
        conns = {"inbox": SimpleNamespace(vendor=inbox), "default": SimpleNamespace(vendor=default)}
        monkeypatch.setattr(partition_checks, "connections", conns)
        monkeypatch.setattr(partition_checks.router, "db_for_write", _inbox_to("inbox"))
        assert [m.id for m in partition_checks.check_partitioned_inbox()] == expected
        monkeypatch.undo()

    today = period_start(timezone.now(), 1)
    with connection.cursor() as cursor:
        for p in partitions():
            if p.start is not None and p.start > today:
                cursor.execute(f"DROP TABLE {p.name}")
    assert [m.id for m in partition_checks.check_partitions(databases=["default"])] == [
        "idempotent_orders.W063"
    ]
    settings.IDEMPOTENT_ORDERS = {**settings.IDEMPOTENT_ORDERS, "INBOX_PARTITION_DAYS": 0}
    assert [m.id for m in partition_checks.check_partitions(databases=["default"])] == [
        "idempotent_orders.W062"
    ]
    settings.IDEMPOTENT_ORDERS = {**settings.IDEMPOTENT_ORDERS, "INBOX_PARTITION_DAYS": 1}
    if is_partitioned():
        revert()
    assert [m.id for m in partition_checks.check_partitions(databases=["default"])] == [
        "idempotent_orders.W061"
    ]
    convert()


def test_a_busy_inbox_postpones_the_drop_and_loses_nothing(partitioned, make_order) -> None:
    now = timezone.now()
    old = now - timedelta(days=10)
    maintain(now=old, cutoff=old - timedelta(days=30), kept=~purgeable(old))
    first_copy(payment(make_order(), message_id="old-done"), "payments", days_ago=10)
    ProcessedMessage.objects.create(
        consumer="payments", message_id="old-failed", status=InboxStatus.FAILED, created_at=old
    )
    ProcessedMessage.objects.update(updated_at=old)
    holding, release = threading.Event(), threading.Event()
    before = len(partitions())

    def claim_in_flight() -> None:
        try:
            with transaction.atomic():
                consume_message(payment(make_order()), consumer="payments")
                holding.set()
                release.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=claim_in_flight)
    thread.start()
    assert holding.wait(30)
    try:
        report = purge(now=now)
    finally:
        release.set()
        thread.join()
    assert report.inbox == 0  # neither dropped nor deleted row by row
    assert len(partitions()) == before
    assert set(
        ProcessedMessage.objects.filter(message_id__startswith="old-").values_list(
            "message_id", flat=True
        )
    ) == {"old-done", "old-failed"}
    assert purge(now=now).inbox == 1
    assert len(partitions()) < before
    assert partition_of("old-failed") == f"{TABLE}_kept"
