"""consume_batch: one multi-row inbox insert per batch, exactly once like the single path."""

from __future__ import annotations

import random
import re
import threading
from typing import Any
from unittest import mock

import pytest
from django.db import OperationalError, connection, transaction

from idempotent_orders.consuming import batch as batch_module
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import (
    InboxStatus,
    Order,
    OrderStatus,
    Outcome,
    ParkedMessage,
    ProcessedMessage,
)
from idempotent_orders.signals import order_transitioned
from tests.support.messages import payment, shipment
from tests.support.metrics import messages_decided, outcome_counts
from tests.support.services import require_service, wait_until

S = OrderStatus
A, D, P, R, ST = (
    Outcome.APPLIED,
    Outcome.DUPLICATE,
    Outcome.PARKED,
    Outcome.REJECTED,
    Outcome.STALE,
)


def state(order: Order) -> tuple[str, int, int]:
    row = Order.objects.get(pk=order.pk)
    return row.status, row.version, row.last_seq


@pytest.mark.django_db
def test_new_messages_apply_and_a_second_delivery_is_all_duplicates(make_order) -> None:
    orders = [make_order() for _ in range(5)]
    messages = [payment(o) for o in orders]
    assert consume_batch(messages, consumer="payments") == [A] * 5
    assert all(state(o) == (S.PAID, 1, 0) for o in orders)
    rows = ProcessedMessage.objects.filter(consumer="payments")
    assert sorted((r.message_id, r.order_id, r.status, r.outcome) for r in rows) == sorted(
        (m["message_id"], m["order_id"], InboxStatus.DONE, Outcome.APPLIED) for m in messages
    )
    assert Order.objects.get(pk=orders[0].pk).payment_id == f"pay-{orders[0].pk}"
    assert consume_batch(messages, consumer="payments") == [D] * 5
    assert all(state(o) == (S.PAID, 1, 0) for o in orders)
    assert ProcessedMessage.objects.count() == 5


@pytest.mark.django_db
def test_copies_within_one_batch_and_across_batches(make_order) -> None:
    first, second = make_order(), make_order()
    m1, m2 = payment(first), payment(second)
    assert consume_batch([m1, m1, m1], consumer="payments") == [A, D, D]
    assert consume_batch([m2, m1, m2], consumer="payments") == [A, D, D]
    assert state(first) == state(second) == (S.PAID, 1, 0)
    assert ProcessedMessage.objects.count() == 2


@pytest.mark.django_db
def test_several_steps_of_one_order_in_one_batch(make_order) -> None:
    order = make_order()
    messages = [payment(order), shipment(order), shipment(order, "delivered")]
    assert consume_batch(messages, consumer="shipping") == [A, A, A]
    assert state(order) == (S.COMPLETED, 3, 0)
    assert Order.objects.get(pk=order.pk).tracking_number == f"TRK{order.pk}"


@pytest.mark.django_db
def test_early_messages_park_and_are_released_after_the_batch(make_order) -> None:
    order = make_order()
    deliver, ship, pay = shipment(order, "delivered"), shipment(order), payment(order)
    assert consume_batch([deliver, ship], consumer="shipping") == [P, P]
    assert ParkedMessage.objects.filter(order=order).count() == 2
    assert consume_batch([pay], consumer="payments") == [A]
    assert state(order) == (S.COMPLETED, 3, 0)
    assert not ParkedMessage.objects.exists()
    assert set(ProcessedMessage.objects.values_list("outcome", flat=True)) == {Outcome.APPLIED}


@pytest.mark.django_db
def test_sequence_gap_within_a_batch(make_order) -> None:
    order = make_order()
    messages = [shipment(order, seq=2), payment(order, seq=1), payment(order, seq=1)]
    assert consume_batch(messages, consumer="orders") == [P, A, ST]
    # The parked dispatch was released once the batch committed.
    assert state(order) == (S.SHIPPED, 2, 2)
    assert not ParkedMessage.objects.exists()


@pytest.mark.django_db
def test_in_sequence_message_without_effect_advances_last_seq(make_order) -> None:
    order = make_order()
    assert consume_batch([payment(order, seq=1)], consumer="payments") == [A]
    messages = [shipment(order, seq=3), payment(order, seq=2)]
    assert consume_batch(messages, consumer="payments") == [P, D]
    assert state(order) == (S.SHIPPED, 2, 3)


@pytest.mark.django_db
def test_rejections_keep_their_reasons(make_order) -> None:
    order, cancelled = make_order(), make_order()
    consume_message(
        {"message_id": "c1", "type": "order.cancelled", "order_id": cancelled.pk},
        consumer="payments",
    )
    wrong_amount = payment(order, amount="99.00")
    too_late = payment(cancelled)
    unknown = {**payment(order), "message_id": "u1", "order_id": 10**9}
    garbage = {"message_id": "g1", "type": "nonsense"}
    good = payment(order)
    outcomes = consume_batch(
        [wrong_amount, too_late, unknown, garbage, good, unknown], consumer="payments"
    )
    assert outcomes == [R, R, R, R, A, D]
    errors = dict(
        ProcessedMessage.objects.filter(status=InboxStatus.REJECTED).values_list(
            "message_id", "error"
        )
    )
    assert "does not match" in errors[wrong_amount["message_id"]]
    assert "never" in errors[too_late["message_id"]]
    assert errors["u1"] == f"unknown order {10**9}"
    assert "unknown message type" in errors["g1"]
    assert ProcessedMessage.objects.get(message_id="u1").order_id is None
    assert '"order_id"' in ProcessedMessage.objects.get(message_id="u1").body
    assert state(order) == (S.PAID, 1, 0)
    assert state(cancelled) == (S.CANCELLED, 1, 0)


@pytest.mark.django_db
def test_long_batches_are_split_into_chunks(make_order, monkeypatch) -> None:
    monkeypatch.setattr(batch_module, "CHUNK", 3)
    orders = [make_order() for _ in range(7)]
    messages = [payment(o) for o in orders] + [payment(orders[0])]
    assert consume_batch(messages, consumer="payments") == [A] * 7 + [D]
    assert all(state(o) == (S.PAID, 1, 0) for o in orders)


@pytest.mark.django_db
def test_transition_signals_are_sent_after_commit(
    make_order, django_capture_on_commit_callbacks
) -> None:
    order = make_order()
    seen: list[tuple[str, str, str, int]] = []

    def on_transition(**kwargs: Any) -> None:
        seen.append((kwargs["transition"], kwargs["source"], kwargs["target"], kwargs["version"]))

    order_transitioned.connect(on_transition)
    try:
        with django_capture_on_commit_callbacks(execute=False) as callbacks:
            consume_batch([payment(order), shipment(order)], consumer="payments")
        assert seen == []
        for callback in callbacks:
            callback()
    finally:
        order_transitioned.disconnect(on_transition)
    assert seen == [("pay", S.PENDING_PAYMENT, S.PAID, 1), ("ship", S.PAID, S.SHIPPED, 2)]


def _script(rng: random.Random, order: Order) -> list[dict[str, Any]]:
    """A random mix of one order's messages: copies, new ids for old steps, gaps, cancels."""
    steps = [
        payment(order, message_id=f"p-{order.pk}"),
        shipment(order, message_id=f"s-{order.pk}"),
        shipment(order, "delivered", message_id=f"d-{order.pk}"),
    ]
    pool = [*steps, payment(order), shipment(order)]
    if rng.random() < 0.2:
        pool.append(
            {"message_id": f"c-{order.pk}", "type": "order.cancelled", "order_id": order.pk}
        )
    script = [rng.choice(pool) for _ in range(rng.randint(1, 6))]
    if rng.random() < 0.5:
        script = steps + script  # usually the whole path happens somewhere
    return script


@pytest.mark.django_db
@pytest.mark.parametrize("seed", range(5))
def test_batch_ends_where_one_at_a_time_ends(make_order, seed: int) -> None:
    rng = random.Random(seed)
    pairs = [(make_order(), make_order()) for _ in range(8)]
    single: list[dict[str, Any]] = []
    batched: list[dict[str, Any]] = []
    for one, other in pairs:
        script = _script(rng, one)
        single += script
        # The same script for the twin order; the inbox is per consumer, ids may repeat.
        batched += [
            {**m, "order_id": other.pk, "payload": {**m.get("payload", {})}} for m in script
        ]
    for m, twin in zip(single, batched, strict=True):
        if m["type"].startswith("payment"):
            # The twin's own charge (a payment pays one order), named alike.
            twin["payload"]["payment_id"] = f"{m['payload']['payment_id']}-twin"
    rng.shuffle(order := list(range(len(single))))
    single = [single[i] for i in order]
    batched = [batched[i] for i in order]
    for m in single:
        consume_message(m, consumer="single")
    outcomes = consume_batch(batched, consumer="batch")
    for one, other in pairs:
        assert state(one) == state(other)
    assert outcomes.count(A) <= sum(state(other)[1] for _, other in pairs)
    # Every transition was applied by exactly one message on either side.
    applied = ProcessedMessage.objects.filter(outcome=Outcome.APPLIED)
    versions = sum(state(one)[1] for one, _ in pairs)
    assert applied.filter(consumer="single").count() == versions
    assert applied.filter(consumer="batch").count() == versions
    still_parked = ParkedMessage.objects.filter
    assert still_parked(consumer="single").count() == still_parked(consumer="batch").count()


@pytest.mark.django_db(transaction=True)
@pytest.mark.backends("postgresql", "mysql")
def test_concurrent_overlapping_batches_apply_each_step_once(make_order) -> None:
    orders = [make_order() for _ in range(30)]
    messages = [payment(o) for o in orders] + [shipment(o) for o in orders]
    transitions: list[int] = []
    lock = threading.Lock()

    def on_transition(order: Order, **kwargs: Any) -> None:
        with lock:
            transitions.append(order.pk)

    order_transitioned.connect(on_transition)
    errors: list[BaseException] = []
    results: list[list[Outcome]] = []

    def run(seed: int) -> None:
        rng = random.Random(seed)
        mine = rng.sample(messages, k=len(messages) * 2 // 3)
        try:
            for attempt in range(5):
                try:
                    results.append(consume_batch(mine, consumer="payments"))
                    break
                except OperationalError:
                    # What the Celery task does: the single path's release of a
                    # parked message can be a MariaDB deadlock victim; a retry
                    # finds the batch's messages as duplicates and releases again.
                    if attempt == 4:
                        raise
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        order_transitioned.disconnect(on_transition)
    assert errors == []
    assert ProcessedMessage.objects.count() <= len(messages)
    assert len(results) == 4
    # Whatever interleaving happened, each order moved at most once per step.
    for order in orders:
        status, version, _ = state(order)
        assert version == {S.PENDING_PAYMENT: 0, S.PAID: 1, S.SHIPPED: 2}[status]
    assert len(transitions) == sum(state(o)[1] for o in orders)
    # Consuming everything once more finishes every order, still once per step.
    consume_batch(messages, consumer="payments")
    assert all(state(o) == (S.SHIPPED, 2, 0) for o in orders)
    assert ProcessedMessage.objects.count() == len(messages)
    assert not ParkedMessage.objects.exists()
    assert ProcessedMessage.objects.filter(outcome=Outcome.APPLIED).count() == 2 * len(orders)


@pytest.mark.django_db(transaction=True)
@pytest.mark.workers
@pytest.mark.backends("postgresql", "mysql")
def test_batch_task_on_real_workers_redelivered_batches(make_order, celery_workers) -> None:
    from django.conf import settings

    from idempotent_orders.tasks import consume_batch_task

    require_service("redis", settings.REDIS_URL)
    orders = [make_order() for _ in range(40)]
    pays = [payment(o) for o in orders]
    ships = [shipment(o) for o in orders]
    workers = celery_workers("redis", processes=2)
    # Overlapping batches, each sent twice: the workers race on the same ids.
    batches = [pays[:30], pays[10:], pays + ships[:20], ships, ships[5:25]]
    from celery import current_app

    # An explicit connection: the fixture closed the app's pool when it switched brokers.
    with current_app.connection_for_write() as conn:
        for chunk in batches * 2:
            consume_batch_task.apply_async(args=[chunk, "payments"], connection=conn)
    done = wait_until(
        lambda: (
            ProcessedMessage.objects.count() == 80
            and Order.objects.filter(status=S.SHIPPED).count() == 40
        ),
        timeout=90,
    )
    assert done, workers.log_tail()
    assert all(state(o) == (S.SHIPPED, 2, 0) for o in orders)
    assert ProcessedMessage.objects.filter(outcome=Outcome.APPLIED).count() == 80
    assert not ParkedMessage.objects.exists()


@pytest.mark.django_db
def test_ids_and_values_that_need_quoting_are_stored_as_sent(make_order) -> None:
    # The PostgreSQL statements pass each column as one array literal.
    awkward = ['q"uote', "back\\slash", "{brace},comma", "NULL", "in ner", "ünï-\u2603", "'"]
    orders = [make_order() for _ in awkward]
    pairs = list(zip(orders, awkward, strict=True))
    messages = [payment(o, message_id=m, payment_id=f'{m}"\\{{,}}') for o, m in pairs]
    assert consume_batch(messages, consumer="payments") == [A] * len(awkward)
    rows = ProcessedMessage.objects.filter(consumer="payments")
    assert sorted((r.message_id, r.order_id) for r in rows) == sorted(
        (m, o.pk) for o, m in zip(orders, awkward, strict=True)
    )
    for order, m in zip(orders, awkward, strict=True):
        assert Order.objects.get(pk=order.pk).payment_id == f'{m}"\\{{,}}'
    assert consume_batch(messages, consumer="payments") == [D] * len(awkward)


@pytest.mark.django_db
def test_a_batch_of_only_unknown_orders_is_recorded_rejected(make_order) -> None:
    messages = [
        {**payment(make_order()), "message_id": f"u{n}", "order_id": 10**9 + n} for n in range(3)
    ]
    assert consume_batch(messages, consumer="payments") == [R] * 3
    rows = ProcessedMessage.objects.filter(consumer="payments").order_by("message_id")
    assert [(r.status, r.outcome, r.order_id, r.error) for r in rows] == [
        (InboxStatus.REJECTED, R, None, f"unknown order {10**9 + n}") for n in range(3)
    ]
    assert all(f'"order_id": {10**9 + n}' in r.body for n, r in enumerate(rows))
    assert consume_batch(messages, consumer="payments") == [D] * 3


@pytest.mark.django_db
def test_no_look_for_parked_messages_of_orders_the_batch_found_without_any(make_order) -> None:
    from django.test.utils import CaptureQueriesContext

    orders = [make_order() for _ in range(3)]
    early = make_order()
    with CaptureQueriesContext(connection) as queries:
        outcomes = consume_batch(
            [payment(o) for o in orders] + [shipment(early, seq=2)], consumer="payments"
        )
    assert outcomes == [A, A, A, P]
    parked_table = ParkedMessage._meta.db_table
    # After commit, only the order that now has a parked message is looked at.
    distinct = [q["sql"] for q in queries if parked_table in q["sql"] and "DISTINCT" in q["sql"]]
    assert len(distinct) == 1
    (listed,) = re.findall(r"IN \(([\d, ]+)\)", distinct[0])
    assert {int(pk) for pk in listed.split(",")} == {early.pk}


@pytest.mark.django_db
def test_follow_ups_run_in_the_batch_without_any_signal_receiver(make_order) -> None:
    from idempotent_orders.consuming import running

    written: list[tuple[int, str, str]] = []

    class Recorder:
        def wanted(self, model: Any, target: str) -> bool:
            return target == S.PAID

        def write(self, instance: Any, name: str, result: Any) -> None:
            written.append((instance.pk, name, result.target))

    orders = [make_order() for _ in range(2)]
    recorder = Recorder()
    running.register_follow_up(recorder)
    try:
        consume_batch([payment(o) for o in orders], consumer="payments")
    finally:
        running._follow_ups.remove(recorder)
    assert sorted(written) == sorted((o.pk, "pay", S.PAID) for o in orders)


@pytest.mark.django_db
def test_a_redelivered_batch_is_answered_by_the_fast_path_with_one_redis_read(
    make_order, django_capture_on_commit_callbacks
) -> None:
    from django.test.utils import CaptureQueriesContext

    from idempotent_orders import dedup
    from tests.support.services import RedisServer, private_redis_settings

    server = RedisServer()
    server.start()
    try:
        with private_redis_settings(server.url):
            dedup.reset()
            messages = [payment(make_order()) for _ in range(4)]
            with django_capture_on_commit_callbacks(execute=True):
                assert consume_batch(messages, consumer="payments") == [A] * 4
            one_get_each = AssertionError("a Redis GET per message")
            with (
                mock.patch.object(dedup.redis, "contains", side_effect=one_get_each),
                CaptureQueriesContext(connection) as queries,
            ):
                assert consume_batch(messages, consumer="payments") == [D] * 4
            assert len(queries) == 0
    finally:
        server.stop()


@pytest.mark.django_db(transaction=True)  # message_consumed is sent after commit
@pytest.mark.parametrize("listening", [False, True])
def test_every_outcome_of_a_batch_is_counted_whether_or_not_anyone_listens(
    make_order, listening: bool
) -> None:
    # With only the app's own counters connected, a batch counts per outcome at once
    # (no signal per message); a receiver of anyone's gets every message, as before.
    from collections import Counter

    from idempotent_orders import stats
    from idempotent_orders.signals import message_consumed

    def metric(outcome: Outcome) -> float:
        return messages_decided("payments", outcome)

    heard: list[tuple[str, Outcome]] = []

    def on_consumed(sender: Any, message_id: str, outcome: Outcome, **kwargs: Any) -> None:
        heard.append((message_id, outcome))

    first, second = make_order(), make_order()
    unknown = {**payment(second), "message_id": "to-nowhere", "order_id": 10**9}
    messages = [payment(first), payment(first), payment(second), unknown]
    stats.reset()
    before = {o: metric(o) for o in Outcome}
    if listening:
        message_consumed.connect(on_consumed)
    try:
        outcomes = consume_batch(messages, consumer="payments")
        outcomes += consume_batch(messages[:1], consumer="payments")
    finally:
        message_consumed.disconnect(on_consumed)
    assert outcomes == [A, D, A, R, D]
    expected = Counter(outcomes)
    assert outcome_counts() == {f"outcome:{o}": n for o, n in expected.items()}
    grown = {o: metric(o) - before[o] for o in expected}
    assert grown == {o: float(n) for o, n in expected.items()}
    if listening:
        assert sorted(heard) == sorted(
            zip([m["message_id"] for m in messages + messages[:1]], outcomes, strict=True)
        )
    else:
        assert heard == []


@pytest.mark.django_db
def test_a_chunk_records_each_payment_it_applies_and_refuses_one_spent_before(
    make_order,
) -> None:
    from idempotent_orders.models import SpentPayment

    first, second, third, fourth = (make_order() for _ in range(4))
    paid = [payment(first), payment(second)]
    assert consume_batch(paid, consumer="payments") == [A, A]
    expected = [
        (m["payload"]["payment_id"], m["order_id"], "payments", m["message_id"]) for m in paid
    ]
    recorded = SpentPayment.objects.values_list("payment_id", "order_id", "consumer", "message_id")
    assert sorted(recorded) == sorted(expected)
    # The first order's payment id again, for another order: the chunk's insert fails,
    # its messages go one by one, and that one is money to give back.
    again = payment(fourth, payment_id=f"pay-{first.pk}")
    assert consume_batch([payment(third, payment_id="fresh"), again], consumer="payments") == [A, R]
    assert state(fourth) == (S.PENDING_PAYMENT, 0, 0)
    row = ProcessedMessage.objects.get(message_id=again["message_id"])
    assert "give back" in row.error
    assert SpentPayment.objects.get(payment_id=f"pay-{first.pk}").order_id == first.pk
    assert SpentPayment.objects.get(payment_id="fresh").order_id == third.pk


@pytest.mark.django_db(transaction=True)
def test_on_the_save_road_a_batch_saves_each_transition_once_and_commits_once(
    make_order,
) -> None:
    """A ``post_save`` receiver puts the model on the save() road: each transition of the
    chunk is a ``save()`` of its own, in arrival order, in the chunk's one transaction; a
    receiver that raises fails its own message alone, and no other message's save runs
    twice."""
    from django.db.models.signals import post_save

    orders = [make_order() for _ in range(4)]
    saves: list[tuple[int, str, bool]] = []

    def watch(sender: Any, instance: Order, created: bool, **kwargs: Any) -> None:
        if created:
            return
        saves.append((instance.pk, instance.status, connection.in_atomic_block))
        if instance.pk == orders[2].pk and instance.status == S.SHIPPED:
            raise RuntimeError("the receiver refuses this shipment")

    messages = [m for o in orders for m in (payment(o), shipment(o))]
    post_save.connect(watch, sender=Order, weak=False, dispatch_uid="test-batch-save-road")
    commits: list[str] = []
    wrapper = transaction.get_connection()
    try:
        with (
            mock.patch.object(
                batch_module, "_one_by_one", side_effect=AssertionError("one by one")
            ),
            mock.patch.object(batch_module, "SAVEPOINT_CHUNK", 3),
            mock.patch.object(
                batch_module, "_consume_chunk", wraps=batch_module._consume_chunk
            ) as chunks,
            mock.patch.object(
                type(wrapper), "commit", autospec=True, side_effect=type(wrapper).commit
            ) as committed,
            connection.execute_wrapper(
                lambda execute, sql, *a: (
                    (commits.append(sql) if "COMMIT" in sql.upper() else None) or execute(sql, *a)
                )
            ),
        ):
            outcomes = consume_batch(messages, consumer="payments")
    finally:
        post_save.disconnect(sender=Order, dispatch_uid="test-batch-save-road")
    assert outcomes == [A, A, A, A, A, Outcome.FAILED, A, A]
    # A savepoint a message: at most SAVEPOINT_CHUNK messages a transaction.
    assert chunks.call_count == 3
    # One save() a transition, in the order the messages came, each in the transaction;
    # the refused one once (rolled back to its savepoint), no other one again.
    assert saves == [(o.pk, status, True) for o in orders for status in (S.PAID, S.SHIPPED)]
    assert [state(o)[:2] for o in orders] == [
        (S.SHIPPED, 2),
        (S.SHIPPED, 2),
        (S.PAID, 1),
        (S.SHIPPED, 2),
    ]
    failed = ProcessedMessage.objects.get(message_id=messages[5]["message_id"])
    assert failed.status == InboxStatus.FAILED
    assert "the receiver refuses this shipment" in failed.error
    # Nothing of a chunk committed one message at a time: no statement's text commits,
    # and Django committed one transaction a chunk.
    assert commits == []
    assert committed.call_count == chunks.call_count


@pytest.mark.django_db(transaction=True)
def test_on_the_save_road_a_messages_first_statement_reads_writes_and_fails_as_sent(
    make_order,
) -> None:
    """The savepoint a message's code runs in may travel in the text of that code's first
    statement: what that statement reads, the row it inserts and the error it raises are
    its own, and a failure rolls back its message alone."""
    from django.db.models.signals import pre_save

    from idempotent_orders.models import OutboxMessage

    OutboxMessage.objects.create(message_id="taken", task_name="t", payload={})
    orders = [make_order() for _ in range(4)]
    reads, inserted = [], []
    with connection.cursor() as cursor:  # this session's own table
        cursor.execute("CREATE TEMPORARY TABLE io_checked (b integer CHECK (b >= 0))")

    def first_statement(sender: Any, instance: Order, **kwargs: Any) -> None:
        if instance.status != S.PAID:
            return
        which = orders.index(next(o for o in orders if o.pk == instance.pk))
        if which == 0:  # a read: its rows, not the savepoint's
            reads.append(OutboxMessage.objects.filter(message_id="taken").count())
        elif which == 1:  # an insert: its own primary key back
            inserted.append(
                OutboxMessage.objects.create(message_id="new", task_name="t", payload={})
            )
        elif which == 2:  # a unique index refuses it
            OutboxMessage.objects.create(message_id="taken", task_name="t", payload={})
        else:  # a CHECK constraint refuses it (MariaDB's driver files that as operational)
            with connection.cursor() as cursor:
                cursor.execute("INSERT INTO io_checked (b) VALUES (-1)")

    pre_save.connect(first_statement, sender=Order, weak=False, dispatch_uid="test-first-stmt")
    try:
        with mock.patch.object(
            batch_module, "_one_by_one", side_effect=AssertionError("one by one")
        ):
            outcomes = consume_batch([payment(o) for o in orders], consumer="payments")
    finally:
        pre_save.disconnect(sender=Order, dispatch_uid="test-first-stmt")
    assert outcomes == [A, A, Outcome.FAILED, Outcome.FAILED]
    assert reads == [1]
    assert [row.pk for row in inserted] == [OutboxMessage.objects.get(message_id="new").pk]
    assert [state(o)[0] for o in orders] == [S.PAID, S.PAID, S.PENDING_PAYMENT, S.PENDING_PAYMENT]
    failed = ProcessedMessage.objects.filter(status=InboxStatus.FAILED)
    assert sorted(r.order_id for r in failed) == [orders[2].pk, orders[3].pk]
    assert all("IntegrityError" in r.error for r in failed), [r.error for r in failed]
    assert OutboxMessage.objects.filter(message_id="taken").count() == 1


@pytest.mark.django_db(transaction=True)
def test_on_the_save_road_a_messages_savepoint_travels_with_its_first_statement(
    make_order,
) -> None:
    """Where the driver takes several statements a text, no statement the chunk sends is a
    savepoint alone: each message's ``SAVEPOINT`` (and the ``RELEASE`` of the one before)
    goes with its ``save()``'s UPDATE. Elsewhere each message takes its own."""
    from django.db.models.signals import post_save
    from django.test.utils import CaptureQueriesContext

    from idempotent_orders.vendors import vendor

    def heard(sender: Any, **kwargs: Any) -> None:
        pass

    orders = [make_order() for _ in range(4)]
    post_save.connect(heard, sender=Order, weak=False, dispatch_uid="test-savepoint-travels")
    try:
        with CaptureQueriesContext(connection) as sent:
            assert consume_batch([payment(o) for o in orders], consumer="payments") == [A] * 4
    finally:
        post_save.disconnect(sender=Order, dispatch_uid="test-savepoint-travels")

    def parts(sql: str) -> list[str]:
        return [p.strip().upper() for p in sql.split(";") if p.strip()]

    savepoints = ("SAVEPOINT", "RELEASE SAVEPOINT")
    alone = [q["sql"] for q in sent if all(p.startswith(savepoints) for p in parts(q["sql"]))]
    if vendor().several_statements(connection):
        assert alone == []
    else:
        taken = [p for sql in alone for p in parts(sql) if p.startswith("SAVEPOINT")]
        assert len(taken) == len(orders)
    assert [state(o)[0] for o in orders] == [S.PAID] * 4
