"""Differential: ``consume_batch`` under any chunking ends where ``consume_message`` ends.

One stream of messages — copies, any order, sequence gaps, invalid payloads,
unknown orders, unknown types, messages without ``seq`` or without an id — is
consumed twice, against two identical sets of orders: once message by message
with :func:`~idempotent_orders.consuming.single.consume_message`, once cut into random
consecutive chunks, each a :func:`~idempotent_orders.consuming.batch.consume_batch` call
(with the module's ``CHUNK`` patched small too, so one call is several
transactions). Both runs must leave the same database state.

What is compared, per side, after the whole stream (orders by their index in
the set, never by primary key; message ids without the per-run prefix):

- every order's ``status``, ``version``, ``last_seq``, ``payment_id``,
  ``tracking_number`` and ``carrier``;
- every inbox row, per ``(consumer, message id)``: the order it points to,
  its type, ``seq``, ``outcome`` and ``status``;
- every parked row: ``(consumer, message id, order, seq)``.

One thing is compared as a multiset instead of row by row, and only for
messages that can never be told apart by their effect: *valid* messages of
one order and one type (so driving one transition) under different ids. The
generator gives all of them the same payload (one ``payment_id`` and one
``tracking_number`` per order), so whichever of them applies writes the same
columns. batch.py documents that within one batch it may record a different
one of them as ``applied`` than the single path does (messages parked before
or within the batch are released after the batch commits) while the order
moves once. For such a group the rows' identities (consumer, id, order, type,
seq) are still compared exactly, and their ``(outcome, status)`` pairs as a
multiset — so "one applied, one duplicate" on both sides passes, "one
applied, one stale" against "two duplicates" does not. Every other message
(an invalid one, an unknown order or type, a message without an id) is
compared exactly. The reason text of a rejection is not compared (it names
primary keys and is worded differently by the two paths); the internal
``has_parked`` flag is not compared either (it is never cleared, and only
says a message was parked at some time).
"""

from __future__ import annotations

import collections
import difflib
import json
import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.test.utils import override_settings
from hypothesis import given
from hypothesis import strategies as st

from idempotent_orders.consuming import batch as batch_module
from idempotent_orders.consuming.backends import at_once
from idempotent_orders.consuming.batch import consume_batch
from idempotent_orders.consuming.single import consume_message
from idempotent_orders.models import Order, OutboxMessage, ParkedMessage, ProcessedMessage

pytestmark = [pytest.mark.backends("sqlite", "postgresql", "mysql")]

AMOUNT = Decimal("99.90")
CURRENCY = "CNY"
#: Primary keys no order has: "unknown order" messages point here.
UNKNOWN_ORDER = 10**12

#: Kinds whose payload is the same for every message of one order and type, and valid
#: whatever the order's state: ids of one (order, type) are interchangeable (see above).
VALID_KINDS = ("pay", "ship", "deliver", "cancel", "refund")
#: Kinds that never apply: rejected for their payload, envelope, order or type (a
#: delivery with the wrong parcel may wait parked first).
INVALID_KINDS = (
    "pay_wrong_amount",
    "pay_no_payment_id",
    "ship_no_tracking",
    "deliver_wrong_tracking",
    "unknown_type",
    "no_message_id",
)
KINDS = VALID_KINDS + INVALID_KINDS

_TYPES = {
    "pay": "payment.succeeded",
    "pay_wrong_amount": "payment.succeeded",
    "pay_no_payment_id": "payment.succeeded",
    "refund": "payment.refunded",
    "ship": "shipment.dispatched",
    "ship_no_tracking": "shipment.dispatched",
    "deliver": "shipment.delivered",
    "deliver_wrong_tracking": "shipment.delivered",
    "cancel": "order.cancelled",
    "unknown_type": "payment.exploded",
    "no_message_id": "payment.succeeded",
}


@dataclass(frozen=True)
class Msg:
    """One distinct message of the stream; ``order`` is an index, None an unknown order."""

    label: str
    kind: str
    order: int | None
    seq: int | None

    def __repr__(self) -> str:
        where = "unknown" if self.order is None else f"o{self.order}"
        seq = "" if self.seq is None else f" seq={self.seq}"
        return f"{self.label}:{self.kind}({where}{seq})"

    @property
    def message_type(self) -> str:
        return _TYPES[self.kind]

    @property
    def interchangeable(self) -> bool:
        return self.kind in VALID_KINDS and self.order is not None

    def consumer(self, split: bool) -> str:
        if not split:
            return "orders"
        return "shipping" if self.message_type.startswith("shipment.") else "payments"

    def build(self, *, prefix: str, orders: Sequence[Order]) -> dict[str, Any]:
        """The concrete envelope for one side of the run."""
        index = self.order if self.order is not None else 0
        pk = orders[self.order].pk if self.order is not None else UNKNOWN_ORDER
        # Each side its own charges (a payment id pays one order): the prefix is
        # left out of the snapshot.
        pay = {"payment_id": f"{prefix}pay-{index}", "amount": str(AMOUNT), "currency": CURRENCY}
        parcel = {"tracking_number": f"T{index}", "carrier": "sf"}
        payload: dict[str, Any] = {
            "pay": pay,
            "refund": pay,
            "no_message_id": pay,
            "unknown_type": pay,
            "pay_wrong_amount": {**pay, "amount": "1.00"},
            "pay_no_payment_id": {k: v for k, v in pay.items() if k != "payment_id"},
            "ship": parcel,
            "deliver": parcel,
            "ship_no_tracking": {"carrier": "sf"},
            "deliver_wrong_tracking": {**parcel, "tracking_number": "elsewhere"},
            "cancel": {},
        }[self.kind]
        message: dict[str, Any] = {
            "message_id": f"{prefix}{self.label}",
            "type": self.message_type,
            "order_id": pk,
            "payload": dict(payload),
        }
        if self.kind == "no_message_id":
            # Recorded under a digest of the whole message: the trace keeps the two
            # sides' digests apart and names the message in the snapshot.
            del message["message_id"]
            message["trace"] = f"{prefix}{self.label}"
        if self.seq is not None:
            message["seq"] = self.seq
        return message


@dataclass(frozen=True)
class Stream:
    orders: int
    messages: tuple[Msg, ...]
    #: Indices into ``messages``, in delivery order (copies and permutations).
    deliveries: tuple[int, ...]
    #: Cut the deliveries before these positions into consume_batch calls.
    cuts: frozenset[int] = frozenset()
    #: batch.CHUNK for the batch side.
    chunk: int = 500
    #: payments/shipping consumers by type (chunks are cut at consumer changes too),
    #: or one consumer for everything.
    split_consumers: bool = False

    def __repr__(self) -> str:
        delivered = ", ".join(repr(self.messages[i]) for i in self.deliveries)
        return (
            f"Stream(orders={self.orders}, chunk={self.chunk}, "
            f"split_consumers={self.split_consumers}, cuts={sorted(self.cuts)}, "
            f"deliveries=[{delivered}])"
        )

    def chunks(self) -> list[tuple[str, list[int]]]:
        """``(consumer, delivery indices)`` per consume_batch call."""
        out: list[tuple[str, list[int]]] = []
        for pos, index in enumerate(self.deliveries):
            consumer = self.messages[index].consumer(self.split_consumers)
            if not out or pos in self.cuts or out[-1][0] != consumer:
                out.append((consumer, []))
            out[-1][1].append(index)
        return out


#: The path a well-behaved producer takes; a message of a script is usually its step.
LIFECYCLE = ("pay", "ship", "deliver", "pay")


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    """Per order a script (mostly the lifecycle, any kind anywhere), numbered 1, 2, 3... when
    the order's producer uses ``seq`` (with gaps, repeats and missing numbers), a few
    messages for unknown orders; every message delivered at least once, some more, in
    any order."""
    n_orders = draw(st.integers(1, 3))
    messages: list[Msg] = []
    for order in range(n_orders):
        with_seq = draw(st.booleans())
        for step in range(draw(st.integers(1, 4))):
            kind = draw(st.one_of(st.just(LIFECYCLE[step]), st.sampled_from(KINDS)))
            seq = (
                draw(st.one_of(st.just(step + 1), st.none(), st.integers(1, 5)))
                if with_seq
                else None
            )
            messages.append(Msg(f"m{len(messages)}", kind, order, seq))
    for _ in range(draw(st.integers(0, 1))):
        kind = draw(st.sampled_from(KINDS))
        seq = draw(st.one_of(st.none(), st.integers(1, 3)))
        messages.append(Msg(f"m{len(messages)}", kind, None, seq))
    copies = draw(st.lists(st.integers(0, len(messages) - 1), max_size=4))
    deliveries = tuple(draw(st.permutations([*range(len(messages)), *copies])))
    cuts = (
        draw(st.frozensets(st.integers(1, len(deliveries) - 1)))
        if len(deliveries) > 1
        else frozenset()
    )
    return Stream(
        orders=n_orders,
        messages=tuple(messages),
        deliveries=deliveries,
        cuts=cuts,
        chunk=draw(st.sampled_from([500, 1, 2, 3])),
        split_consumers=draw(st.booleans()),
    )


# --- running one side and reading its state back ------------------------------------------


@dataclass
class Side:
    name: str
    prefix: str
    orders: list[Order]
    inbox_from: int
    parked_from: int


def _start(run: str, name: str, stream: Stream) -> Side:
    last_inbox = ProcessedMessage.objects.order_by("-pk").values_list("pk", flat=True).first()
    last_parked = ParkedMessage.objects.order_by("-pk").values_list("pk", flat=True).first()
    orders = [
        Order.objects.create(
            business_key=f"diff-{run}-{name}-{i}", amount=AMOUNT, currency=CURRENCY
        )
        for i in range(stream.orders)
    ]
    return Side(name, f"{run}{name[0]}-", orders, last_inbox or 0, last_parked or 0)


def run_single(stream: Stream, run: str, name: str = "single") -> Side:
    side = _start(run, name, stream)
    for index in stream.deliveries:
        msg = stream.messages[index]
        consume_message(
            msg.build(prefix=side.prefix, orders=side.orders),
            consumer=msg.consumer(stream.split_consumers),
        )
    return side


def run_batch(stream: Stream, run: str) -> Side:
    side = _start(run, "batch", stream)
    with mock.patch.object(batch_module, "CHUNK", stream.chunk):
        for consumer, indices in stream.chunks():
            consume_batch(
                [stream.messages[i].build(prefix=side.prefix, orders=side.orders) for i in indices],
                consumer=consumer,
            )
    return side


def snapshot(stream: Stream, side: Side) -> dict[str, Any]:
    """The side's database state, normalised so that the two sides compare equal."""
    index = {o.pk: n for n, o in enumerate(side.orders)}
    by_label = {m.label: m for m in stream.messages}
    trace = re.compile(r'"trace": "' + re.escape(side.prefix) + r'(m\d+)"')

    def label(message_id: str, body: str = "") -> str:
        if message_id.startswith(side.prefix):
            return message_id[len(side.prefix) :]
        found = trace.search(body)
        return f"<no id>{found.group(1)}" if found else f"<foreign>{message_id}"

    orders = {}
    for order in Order.objects.filter(pk__in=index):
        orders[f"order {index[order.pk]}"] = {
            "status": order.status,
            "version": order.version,
            "last_seq": order.last_seq,
            "payment_id": order.payment_id.removeprefix(side.prefix),
            "tracking_number": order.tracking_number,
            "carrier": order.carrier,
        }

    inbox: dict[str, Any] = {}
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for row in ProcessedMessage.objects.filter(pk__gt=side.inbox_from):
        name = label(row.message_id, row.body)
        msg = by_label.get(name)
        key = f"{row.consumer}:{name}"
        ident = {
            "order": index.get(row.order_id) if row.order_id is not None else None,
            "type": row.message_type,
            "seq": row.seq,
        }
        verdict = f"{row.outcome}/{row.status}"
        if msg is not None and msg.interchangeable:
            inbox[key] = {**ident, "outcome": "(see group)"}
            groups[f"{row.consumer}:order {msg.order}:{msg.message_type}"].append(verdict)
        else:
            inbox[key] = {**ident, "outcome": verdict}

    parked = sorted(
        (p.consumer, label(p.message_id), index.get(p.order_id), p.seq)
        for p in ParkedMessage.objects.filter(pk__gt=side.parked_from)
    )
    return {
        "orders": dict(sorted(orders.items())),
        "inbox": dict(sorted(inbox.items())),
        "interchangeable groups (outcome/status multiset)": {
            k: sorted(v) for k, v in sorted(groups.items())
        },
        "parked": [list(p) for p in parked],
    }


def _lines(snap: dict[str, Any]) -> Iterator[str]:
    for section, content in snap.items():
        yield f"[{section}]"
        items = content.items() if isinstance(content, dict) else enumerate(content)
        for key, value in items:
            yield f"  {key}: {json.dumps(value, sort_keys=True)}"


def both_sides(stream: Stream) -> tuple[dict[str, Any], dict[str, Any]]:
    """The snapshots after consuming ``stream`` one by one, and in batches."""
    run = uuid.uuid4().hex[:8]
    return snapshot(stream, run_single(stream, run)), snapshot(stream, run_batch(stream, run))


def assert_same_state(stream: Stream) -> None:
    single, batched = both_sides(stream)
    if single != batched:
        diff = "\n".join(
            difflib.unified_diff(
                list(_lines(single)),
                list(_lines(batched)),
                "consume_message, one by one",
                "consume_batch, " + " | ".join(f"{c}:{i}" for c, i in stream.chunks()),
                lineterm="",
                n=1,
            )
        )
        raise AssertionError(f"single and batch paths differ for\n{stream!r}\n{diff}")


# --- the tests ------------------------------------------------------------------------------


def _m(n: int, kind: str, order: int | None = 0, seq: int | None = None) -> Msg:
    return Msg(f"m{n}", kind, order, seq)


#: Streams that once told the two paths apart; each runs on every leg, whatever
#: the random search finds.
KNOWN = {
    # An invalid message in a sequence gap: the single path parks it and rejects it
    # in its turn (advancing last_seq); the batch path must not reject it at once,
    # or last_seq stays 1 and seq 3 waits for ever.
    "invalid_message_in_a_sequence_gap": Stream(
        orders=1,
        messages=(_m(0, "ship_no_tracking", seq=2), _m(1, "pay", seq=1), _m(2, "ship", seq=3)),
        deliveries=(0, 1, 2),
    ),
    # The same stream, one message per consume_batch call.
    "invalid_message_in_a_sequence_gap_one_per_batch": Stream(
        orders=1,
        messages=(_m(0, "ship_no_tracking", seq=2), _m(1, "pay", seq=1), _m(2, "ship", seq=3)),
        deliveries=(0, 1, 2),
        cuts=frozenset({1, 2}),
    ),
    # The same, when the gap never closes: one by one the message waits parked for
    # seq 1; the batch rejects it at once.
    "invalid_message_in_a_gap_that_never_closes": Stream(
        orders=1,
        messages=(_m(0, "pay_wrong_amount", seq=2),),
        deliveries=(0,),
    ),
    # A message parked in (or before) a batch is released only after the batch
    # commits, so a later message of the same batch overtakes it: one by one the
    # dispatch applies as soon as the payment does and the refund comes too late;
    # in one batch the refund applies first and the dispatch is rejected.
    "later_message_overtakes_a_parked_one": Stream(
        orders=1,
        messages=(_m(0, "ship"), _m(1, "pay"), _m(2, "refund")),
        deliveries=(0, 1, 2),
    ),
    # The same with a sequence gap: the dispatch (seq 2) waits for the payment (seq 1).
    "later_message_overtakes_a_sequence_parked_one": Stream(
        orders=1,
        messages=(_m(0, "ship", seq=2), _m(1, "pay", seq=1), _m(2, "refund")),
        deliveries=(0, 1, 2),
    ),
    # The same cause without another state: a second payment notice is decided
    # before the parked dispatch is released, so it is a duplicate (order paid)
    # where one by one it is stale (order already shipped).
    "later_copy_decided_before_the_release": Stream(
        orders=1,
        messages=(_m(0, "ship"), _m(1, "pay"), _m(2, "pay")),
        deliveries=(0, 1, 2),
    ),
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_known_streams(name: str, transactional_db: None) -> None:
    assert_same_state(KNOWN[name])


@given(stream=streams())
def test_batch_under_any_chunking_ends_where_one_by_one_ends(
    stream: Stream, transactional_db: None
) -> None:
    """Examples: IO_HYPOTHESIS_EXAMPLES / IO_HYPOTHESIS_PROFILE (tests/reliability/conftest.py)."""
    assert_same_state(stream)


def _with_follow_ups(stream: Stream, side: Side) -> dict[str, Any]:
    """:func:`snapshot` and the orders (by index) whose fulfilment follow-up was queued."""
    index = {f"fulfil-{o.pk}": n for n, o in enumerate(side.orders)}
    queued = OutboxMessage.objects.filter(message_id__in=index)
    return {
        **snapshot(stream, side),
        "follow-ups": sorted(index[m] for m in queued.values_list("message_id", flat=True)),
    }


@pytest.mark.backends("sqlite", "mysql")
@pytest.mark.parametrize("fulfil", [True, False], ids=["default", "follow-up-off"])
@given(stream=streams())
def test_the_one_transaction_road_ends_where_the_atomic_road_ends(
    stream: Stream, fulfil: bool, transactional_db: None
) -> None:
    """MariaDB and SQLite send a message's writes as one transaction of their own before
    its order is read (``backends.at_once``); with that road off, the order is read and
    Django's ``atomic`` and the ORM write them. One by one, both must leave the same
    state, follow-ups included."""
    config = {
        **settings.IDEMPOTENT_ORDERS,
        "FULFIL_AFTER_PAYMENT": fulfil,
        "OUTBOX_PUBLISH_ON_COMMIT": False,
    }
    run = uuid.uuid4().hex[:8]
    with override_settings(IDEMPOTENT_ORDERS=config):
        fast = _with_follow_ups(stream, run_single(stream, run, "one"))
        with mock.patch.object(at_once, "can_apply_unread_at_once", return_value=False):
            slow = _with_follow_ups(stream, run_single(stream, run, "atomic"))
    if fast != slow:
        diff = "\n".join(
            difflib.unified_diff(
                list(_lines(fast)), list(_lines(slow)), "one transaction", "atomic", lineterm=""
            )
        )
        raise AssertionError(f"the roads differ for\n{stream!r}\n{diff}")
