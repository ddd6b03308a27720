"""Bad-input corpus: every case is rejected with its reason, once, and workers keep consuming."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from idempotent_orders import tasks
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import (
    InboxStatus,
    Order,
    OrderStatus,
    Outcome,
    ProcessedMessage,
)
from tests.support.chaos import Planned, build_stream, check_invariants, make_orders
from tests.support.corpus import BadCase, corpus
from tests.support.services import wait_until

S = OrderStatus


def _orders(make_order: Callable[..., Order]) -> tuple[Order, Order]:
    order = make_order()
    cancelled = make_order()
    cancel = {"message_id": f"c-{uuid.uuid4().hex}", "type": "order.cancelled"}
    assert consume_message(cancel | {"order_id": cancelled.pk}, consumer="payments") == "applied"
    return order, cancelled


def test_corpus_has_at_least_30_cases(make_order: Callable[..., Order], db: None) -> None:
    order, cancelled = _orders(make_order)
    cases = corpus(order, cancelled, tag="count")
    assert len(cases) >= 30
    assert len({c.name for c in cases}) == len(cases)


@pytest.mark.django_db
def test_each_case_is_rejected_with_its_reason_exactly_once(
    make_order: Callable[..., Order],
) -> None:
    order, cancelled = _orders(make_order)
    for case in corpus(order, cancelled, tag=uuid.uuid4().hex[:6]):
        before = ProcessedMessage.objects.count()
        outcome = consume_message(case.message, consumer="payments")
        assert outcome == Outcome.REJECTED, case.name
        assert ProcessedMessage.objects.count() == before + 1, case.name
        row = ProcessedMessage.objects.order_by("-id").first()
        assert row is not None
        assert row.status == InboxStatus.REJECTED, case.name
        assert case.reason in row.error.lower(), (case.name, row.error)
        assert "\x00" not in row.body + row.error + row.message_id, case.name
        assert len(row.body) <= 4096 + 64, case.name
        # The same bad message again is recognised, not recorded twice.
        assert consume_message(case.message, consumer="payments") == Outcome.DUPLICATE, case.name
        assert ProcessedMessage.objects.count() == before + 1, case.name
    # None of it touched the orders, and SQL-looking text stayed text.
    order.refresh_from_db()
    assert (order.status, order.version, order.payment_id) == (S.PENDING_PAYMENT, 0, "")
    assert Order.objects.filter(pk=cancelled.pk, status=S.CANCELLED, version=1).exists()
    assert ProcessedMessage.objects.filter(message_id="1' OR '1'='1").count() == 1


@pytest.mark.workers
@pytest.mark.services
def test_workers_reject_the_corpus_and_keep_consuming(
    celery_workers: Callable[..., Any], make_order: Callable[..., Order]
) -> None:
    """The corpus interleaved with valid lifecycles, through a real broker and two workers."""
    workers = celery_workers("redis", processes=2)
    order, cancelled = _orders(make_order)
    bad = [c for c in corpus(order, cancelled, tag=uuid.uuid4().hex[:6]) if c.over_the_wire]
    rng = random.Random()
    valid = build_stream(make_orders(6), rng=rng, max_copies=3)
    sends: list[Planned | BadCase] = [valid.planned[i] for i in valid.deliveries] + bad + bad
    rng.shuffle(sends)
    rejected_before = ProcessedMessage.objects.filter(outcome=Outcome.REJECTED).count()
    for item in sends:
        if isinstance(item, BadCase):
            # Not tasks.publish: many of these have no usable message id for a task id.
            tasks.consume_payment.apply_async(args=[item.message])
        else:
            tasks.publish(item.message, consumer=item.consumer)

    def done() -> bool:
        rejected = ProcessedMessage.objects.filter(outcome=Outcome.REJECTED).count()
        return (
            rejected - rejected_before >= len(bad)
            and not check_invariants(valid.planned, dict(valid.final_status)).violations
        )

    assert wait_until(done, timeout=120), workers.log_tail()
    report = check_invariants(valid.planned, dict(valid.final_status))
    assert not report.violations, report.violations
    rejected = ProcessedMessage.objects.filter(outcome=Outcome.REJECTED)
    assert rejected.count() - rejected_before == len(bad)  # each once, though sent twice
    assert not rejected.filter(error="").exists()
    assert all(proc.poll() is None for proc in workers.procs), workers.log_tail()
    order.refresh_from_db()
    assert (order.status, order.version) == (S.PENDING_PAYMENT, 0)
