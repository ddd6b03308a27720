"""A commit in doubt: the connection drops while the message's transaction commits, so the
consumer cannot know whether it took effect. The consume road reads the inbox row back on a
new connection instead of guessing: applied if the row is there, a retry if it is not.

A proxy in front of PostgreSQL cuts the connection at the committing statement, either before
the server sees it (nothing committed) or after the server answered it (committed, the answer
lost). Both roads that commit a message are cut: the one statement that claims and applies it
(autocommit), and the transaction ended by COMMIT (taken when a receiver must run in it)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import DEFAULT_DB_ALIAS, connections
from django_fsm.signals import post_transition

from idempotent_orders import dedup, get_order_model
from idempotent_orders.consuming.failures import TRANSIENT
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import InboxStatus, Outcome, ProcessedMessage
from idempotent_orders.signals import message_consumed
from tests.support.cutting_proxy import CuttingProxy
from tests.support.messages import payment

pytestmark = [
    pytest.mark.backends("postgresql"),
    pytest.mark.services,
    pytest.mark.django_db(transaction=True),
]

#: What each road sends to commit a message.
COMMITTING = {
    "one statement": b'WITH claim AS (INSERT INTO "idempotent_orders_processedmessage"',
    "transaction": b"COMMIT",
}


@pytest.fixture
def proxy() -> Iterator[CuttingProxy]:
    db = connections.settings[DEFAULT_DB_ALIAS]
    cutting = CuttingProxy((db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)))
    yield cutting
    cutting.close()


def through(proxy: CuttingProxy, call: Callable[[], Any]) -> Any:
    """Run ``call`` in a thread whose connections go through ``proxy``; its result, or what it
    raised."""
    saved = connections.settings[DEFAULT_DB_ALIAS]
    options = {**saved["OPTIONS"], "sslmode": "disable", "gssencmode": "disable"}
    changes = {"HOST": "127.0.0.1", "PORT": str(proxy.port), "OPTIONS": options}
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(call())
        except Exception as exc:
            result.append(exc)
        finally:
            connections.close_all()

    connections.settings[DEFAULT_DB_ALIAS] = {**saved, **changes}
    try:
        worker = threading.Thread(target=run)
        worker.start()
        worker.join(60)
    finally:
        connections.settings[DEFAULT_DB_ALIAS] = saved
    assert not worker.is_alive(), "the consume hung"
    return result[0]


@pytest.fixture
def announced() -> Iterator[list[Outcome]]:
    """The outcomes the consume road reported (``message_consumed``)."""
    outcomes: list[Outcome] = []

    def receive(sender: Any, outcome: Outcome, **kwargs: Any) -> None:
        outcomes.append(outcome)

    message_consumed.connect(receive, weak=False, dispatch_uid="in-doubt-test")
    yield outcomes
    message_consumed.disconnect(dispatch_uid="in-doubt-test")


def heard(sender: Any, **kwargs: Any) -> None:
    """A receiver of the order's transitions: the message then commits in a transaction."""


@pytest.fixture(params=list(COMMITTING))
def road(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "transaction":
        post_transition.connect(heard, sender=get_order_model(), dispatch_uid="in-doubt-road")
    yield request.param
    post_transition.disconnect(sender=get_order_model(), dispatch_uid="in-doubt-road")


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "not committed"])
def test_a_commit_in_doubt_is_read_back_and_applied_once(
    make_order: Callable[..., Any],
    proxy: CuttingProxy,
    road: str,
    committed: bool,
    announced: list[Outcome],
) -> None:
    order = make_order()
    message = payment(order)
    key = {"consumer": "payments", "message_id": message["message_id"]}

    proxy.cut(COMMITTING[road], "after" if committed else "before")
    first = through(proxy, lambda: consume_message(message, consumer="payments"))
    # The connection was cut at the committing statement, as asked.
    assert proxy.cuts
    assert proxy.cuts[0][0] == ("after" if committed else "before")
    assert COMMITTING[road] in proxy.cuts[0][1]
    assert not proxy.armed
    # What the server did, which the consumer could not know from its connection.
    assert ProcessedMessage.objects.filter(**key).exists() is committed

    # The broker redelivers the message (it is redelivered whatever the first answer was:
    # a copy may always come again).
    again = through(proxy, lambda: consume_message(message, consumer="payments"))

    if committed:
        # Read back: the message took effect, so the delivery answers "applied" (and is
        # acknowledged); the copy is a duplicate.
        assert first is Outcome.APPLIED
        assert again is Outcome.DUPLICATE
    else:
        # Read back: no inbox row, so the delivery is retried (a transient error)...
        assert isinstance(first, TRANSIENT), first
        # ... and the retry applies it.
        assert again is Outcome.APPLIED
    # Applied exactly once, and reported applied exactly once.
    assert announced.count(Outcome.APPLIED) == 1
    row = ProcessedMessage.objects.get(**key)
    assert (row.status, row.outcome) == (InboxStatus.DONE, Outcome.APPLIED)
    order.refresh_from_db()
    assert (order.status, order.version) == ("paid", 1)


def test_a_copy_cut_at_its_claim_is_not_answered_applied(
    make_order: Callable[..., Any],
    proxy: CuttingProxy,
    road: str,
    announced: list[Outcome],
) -> None:
    """The row read back is this delivery's only if this delivery wrote it: a copy of a
    message applied earlier, cut after the server refused its claim, finds the earlier row
    and is retried (a duplicate then), never answered "applied"."""
    order = make_order()
    message = payment(order)
    assert consume_message(message, consumer="payments") is Outcome.APPLIED
    # The copy reaches the database (the fast path would answer it from Redis).
    dedup.forget("payments", message["message_id"])

    proxy.cut(b'INSERT INTO "idempotent_orders_processedmessage"', "after")
    copy = through(proxy, lambda: consume_message(message, consumer="payments"))
    assert [when for when, _ in proxy.cuts] == ["after"]
    assert isinstance(copy, TRANSIENT), copy
    dedup.forget("payments", message["message_id"])
    again = through(proxy, lambda: consume_message(message, consumer="payments"))
    assert again is Outcome.DUPLICATE
    assert announced.count(Outcome.APPLIED) == 1
    order.refresh_from_db()
    assert order.version == 1
