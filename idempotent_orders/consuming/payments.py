"""A payment pays one order, once: the spent-payment record of messages that carry money.

A message type registered with ``money=True`` (``payment.succeeded`` is) carries a
``payment_id`` in its payload. The transaction that applies it also records the id
in :class:`~idempotent_orders.models.SpentPayment`, whose unique index refuses a
second use: the same payment id for another order is rejected as money to give
back, and for the same order (a new message id for a payment already applied) it
is a duplicate.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from django.db import connection

from idempotent_orders.consuming.backends import backend
from idempotent_orders.consuming.envelope import Envelope
from idempotent_orders.models import SpentPayment

__all__ = [
    "SPENT_FIELDS",
    "Reservation",
    "payment_id",
    "record_spent",
    "spend",
    "spent_by",
    "spent_table",
]


def payment_id(envelope: Envelope) -> str | None:
    """The payment id a money message spends, from the payload key its type names
    (``payment_key``, ``"payment_id"`` unless registered otherwise); None for a message
    that carries no money or names no payment (nothing to record)."""
    if not envelope.handler.money:
        return None
    value = envelope.payload.get(envelope.handler.payment_key)
    if isinstance(value, str) and value and len(value) <= 128:
        return value
    return None


#: The spent-payment fields a payment's row is written with, in the order of
#: :func:`spent_table`'s columns.
SPENT_FIELDS = ("payment_id", "order", "consumer", "message_id")


def spent_table() -> tuple[str, list[str]]:
    """The spent-payment table and its columns, quoted: the payment id (its unique
    index), the order, the consumer, the message id."""
    qn = connection.ops.quote_name
    meta = SpentPayment._meta
    columns = [
        qn(str(meta.get_field(name).column))  # type: ignore[union-attr]
        for name in SPENT_FIELDS
    ]
    return qn(meta.db_table), columns


def spend(payment: str, order_id: Any, consumer: str, message_id: str) -> Any | None:
    """Record ``payment`` as paying ``order_id``, in the caller's transaction.

    Returns None when recorded; otherwise the order the payment was already
    spent on (which may be ``order_id`` itself).
    """
    table, columns = spent_table()
    head, tail = backend().insert_ignoring(table, ", ".join(columns), columns[0])
    sql = f"{head} VALUES (%s, %s, %s, %s) {tail}"
    with connection.cursor() as cursor:
        cursor.execute(sql, [payment, order_id, consumer, message_id])
        if cursor.rowcount == 1:
            return None
    return spent_by(payment)


def spent_by(payment: str) -> Any | None:
    """The order ``payment`` was spent on, or None."""
    return (
        SpentPayment.objects.filter(payment_id=payment).values_list("order_id", flat=True).first()
    )


def record_spent(
    consumer: str, rows: Sequence[tuple[str, Any, str]], *, skip_spent: bool = False
) -> set[str] | None:
    """Record many payments at once: ``rows`` of ``(payment id, order id, message id)``,
    inserted in the order given, in the caller's transaction.

    A payment id spent already fails the insert (``IntegrityError``), unless
    ``skip_spent``: then it is left as it is. Returns the ids inserted where the backend
    writes them in one statement (PostgreSQL's ``unnest``); None where Django's
    ``bulk_create`` writes them and cannot tell.
    """
    inserted = backend().record_spent(consumer, rows, skip_spent)
    if inserted is None:
        SpentPayment.objects.bulk_create(
            [
                SpentPayment(payment_id=p, order_id=o, consumer=consumer, message_id=m)
                for p, o, m in rows
            ],
            ignore_conflicts=skip_spent,
        )
    return inserted


class Reservation:
    """A batch chunk's payment ids, recorded as spent before any of its messages runs.

    One multi-row ``INSERT`` (conflicts ignored) and one ``SELECT`` for the whole chunk
    instead of :func:`spend` per message. Each id goes in under the first message of the
    chunk that carries it; the unique index then makes a concurrent spender of the same
    id wait for the chunk's commit, as :func:`spend` does, before any body runs. A row
    the chunk inserted and no message used is deleted by :meth:`settle`; one used by
    another message of the chunk is handed to it.
    """

    def __init__(self, consumer: str, wanted: Iterable[tuple[str, Any, str]]) -> None:
        """``wanted``: ``(payment id, order id, message id)`` in arrival order."""
        self.consumer = consumer
        first: dict[str, tuple[Any, str]] = {}
        for payment, order_id, message_id in wanted:
            first.setdefault(payment, (order_id, message_id))
        #: The order each id was spent on before the chunk, or by a message of it.
        self.owners: dict[str, Any] = {}
        #: Ids the chunk inserted that no message used yet: the row as inserted.
        self.free: dict[str, tuple[Any, str]] = {}
        #: Ids a message other than the one it was inserted under used.
        self.moved: dict[str, tuple[Any, str]] = {}
        if not first:
            return
        inserted = record_spent(
            consumer,
            [(p, o, m) for p, (o, m) in sorted(first.items())],  # one lock order for every chunk
            skip_spent=True,
        )
        if inserted is not None:
            for payment in inserted:
                self.free[payment] = first[payment]
        others = [p for p in first if p not in self.free]
        if not others:
            return
        found = SpentPayment.objects.filter(payment_id__in=others).values_list(
            "payment_id", "order_id", "consumer", "message_id"
        )
        for payment, order_id, consumer_, message_id in found:
            if (consumer_, message_id) == (consumer, first[payment][1]):
                self.free[payment] = (order_id, message_id)
            else:
                self.owners[payment] = order_id

    def owner(self, payment: str) -> tuple[bool, Any]:
        """``(known, owner)``: whether the chunk knows ``payment``, and the order it was
        spent on (None: free to spend). An id it does not know is spent with :func:`spend`.
        """
        if payment in self.owners:
            return True, self.owners[payment]
        return payment in self.free, None

    def used(self, payment: str, order_id: Any, message_id: str) -> None:
        """``payment`` paid ``order_id`` (the message's transaction kept it)."""
        inserted = self.free.pop(payment, None)
        if inserted is not None and inserted != (order_id, message_id):
            self.moved[payment] = (order_id, message_id)
        self.owners[payment] = order_id

    def settle(self) -> None:
        """Delete the rows no message used; hand the others to the message that used them."""
        if self.free:
            SpentPayment.objects.filter(payment_id__in=list(self.free)).delete()
        for payment, (order_id, message_id) in self.moved.items():
            SpentPayment.objects.filter(payment_id=payment).update(
                order_id=order_id, message_id=message_id
            )
